"""The tests' name for `parity.oracle`, the one float64 oracle of SPEC.md (see there).

Test files import ``from oracle import ...``; the oracle itself lives in the shipped ``parity``
package so that parity's judge and the benchmarks use the same one.
"""

from parity.oracle import (FP8_MAX, fp8_e4m3fn_to_float, oracle_paged_attention,  # noqa: F401
                           oracle_quantize_fp8, oracle_ragged_attention, oracle_write_kv)
from parity.oracle import __all__  # noqa: F401
