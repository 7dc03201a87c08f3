"""Small shared utilities: process spawning for tests and local runs, seeding, timers."""
