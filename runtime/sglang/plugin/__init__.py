"""The SGLang SLA plugin: SLA-weighted DSpark verification split inside SGLang.

* :mod:`.sla_hook` — the import hook + patches (runs inside SGLang's processes).
* :mod:`.install` — writes the ``.pth`` + boot module into SGLang's site-packages.

Both are stdlib only and import nothing else from ``runtime`` (the weight function
``runtime/speculation/sla.py`` is loaded by file path), so this package imports cleanly in
SGLang's own environment. Importing this package does not activate anything.
"""
