"""Kernels. ``cpu/``: the GGUF C++ kernels (AVX512-BF16 / AMX) and their builder;
``gpu/``: Triton kernels with their torch references (tested on CPU with
``TRITON_INTERPRET=1``); :mod:`runtime.kernels.dispatch` picks the path.
Importing this package imports nothing (never triton)."""
