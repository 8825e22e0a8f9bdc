"""Hypothesis profiles of the property tests (`test_properties.py`): a bounded CI run, a long soak.

``PALLAS_PAGED_HYPOTHESIS_PROFILE`` picks one (default ``ci``):

- ``ci``: a few examples per static shape, derandomized (the same examples on every run, so CI
  is stable), about two minutes for the whole file on a 2-core CPU;
- ``long``: 10,000 examples in all, freshly random on every run (a soak; a failure prints the
  seed blob to reproduce it with ``@reproduce_failure``).

The profiles are registered, not loaded: the property tests take `PROFILE` as the parent of their
own ``@settings``, so other test files keep hypothesis's defaults whichever profile is selected.
`EXAMPLES` gives each property test its example count *per static shape bucket*; the totals are
``EXAMPLES[kind] * len(buckets of that kind)`` (see `test_properties.py`).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

ENV_VAR = "PALLAS_PAGED_HYPOTHESIS_PROFILE"

_COMMON = dict(
    deadline=None,  # the first example of a bucket compiles (seconds); the rest take milliseconds
    database=None,  # no example database: a run depends on the profile alone
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

settings.register_profile("pallas-paged-ci", derandomize=True, **_COMMON)
settings.register_profile("pallas-paged-long", derandomize=False, **_COMMON)

# Examples per static bucket, by property. long: 600 * 10 decode buckets + 500 * 6 write buckets
# + 250 * 4 step buckets = 6,000 + 3,000 + 1,000 = 10,000 examples.
_EXAMPLES = {
    "ci": {"decode": 30, "write": 50, "step": 15},
    "long": {"decode": 600, "write": 500, "step": 250},
}

NAME = os.environ.get(ENV_VAR, "ci").strip() or "ci"
if NAME not in _EXAMPLES:
    raise ValueError(f"{ENV_VAR}={NAME!r} must be one of {sorted(_EXAMPLES)}")
PROFILE = settings.get_profile(f"pallas-paged-{NAME}")
EXAMPLES = _EXAMPLES[NAME]
