"""Machine-readable outputs for CI: JUnit XML, GitHub workflow annotations, SARIF."""
