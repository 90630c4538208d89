"""Process groups, the gloo side channel, liveness, and the gather."""
