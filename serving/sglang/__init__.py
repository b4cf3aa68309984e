"""SGLang production tier: SGLangEngine, the trace-capture plugin and the source contract.

Nothing here imports ``sglang`` at module import time: SGLang installs a CUDA stack and is an
optional extra (``pip install specloop[sglang]``). The pinned version and every SGLang symbol we
touch are listed in ``contract.py``; CI checks them against the pinned wheel's source.
"""
