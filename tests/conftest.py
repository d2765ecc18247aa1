"""Settings every test shares."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

# Hypothesis's default 200 ms deadline and its too-slow health check measure the machine, not
# the code: on a loaded 2-core box they fail tests whose outcome is right. Every property
# test here runs without them; a test's own @settings only adds its sizes.
settings.register_profile(
    "nbos", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("nbos")
