"""Suite-wide options. ``--profile pr`` (default) is the fast profile CI runs; ``--profile nightly``
is the heavier one. Hypothesis draws the structure of cases; it is derandomized, so a run's cases
derive from the test's identity, never from the clock."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

PROFILES = ("pr", "nightly")

settings.register_profile(
    "pr",
    max_examples=25,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "nightly",
    max_examples=400,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--profile",
        default="pr",
        choices=PROFILES,
        help="test profile: pr (fast, what CI runs) or nightly (many more cases)",
    )


def pytest_configure(config: pytest.Config) -> None:
    settings.load_profile(config.getoption("--profile"))


@pytest.fixture(scope="session")
def profile(request: pytest.FixtureRequest) -> str:
    """The active profile's name, for tests that size their own sweeps."""
    return request.config.getoption("--profile")
