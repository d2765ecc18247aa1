"""Real servers (started as subprocesses on loopback) shared by test directories."""
