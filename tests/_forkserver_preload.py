"""What a forked rank's megatron-bridge import would otherwise import in every rank, imported once by the forkserver
(`tests/_distributed.py`): ~2.3 s of one core per rank of the ~4.3 s that importing megatron-bridge takes.

Third-party libraries only, none of which reads what `lightning_megatron._compat` adjusts: `datasets` and `peft`
(modelopt's Hugging Face plugins import them) and modelopt's quantization package, imported as
`_compat/quiet.py`'s `modelopt.quiet_import_notices` imports it: its two import notices ignored during the import
only, so that they reach no test's output. megatron-bridge itself needs adjustments to import, which a rank's test
body applies.
"""

import datasets  # noqa: F401
import peft  # noqa: F401

from lightning_megatron._compat.quiet import import_modelopt_quantization_quietly

import_modelopt_quantization_quietly()
