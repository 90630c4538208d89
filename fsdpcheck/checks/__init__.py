"""Pure checks over gathered records."""
