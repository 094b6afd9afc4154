"""GGUF CPU kernels: C++ sources (``gguf_cpu.cpp``, ``fused_layer.cpp``; design in
``gguf_cpu.h`` and ``work_pool.h``; ``verify_chain.cpp``, the speculative verification's
C++ twin) and :mod:`runtime.kernels.cpu.gguf_cpu`, which builds them with
``torch.utils.cpp_extension`` on first use."""
