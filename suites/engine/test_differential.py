"""The differential test: every selected backend x every arch it declares x every case of the
profile (ids ``backend-arch-case``), each judged by ``harness.judge.engine.run_case`` against the exact
oracle and its error bound. On a host without an arch, that arch's tests SKIP with the reason."""

from mxmoe.harness.plugin import check_differential


def test_differential(differential, request):
    check_differential(differential, request)
