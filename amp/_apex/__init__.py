"""NVIDIA Apex's installed layout, rebuilt on amp, served only through the drop-in switch
(``python -m amp.apex enable``; ``amp._apex_finder`` decides what answers each import).

``apex/`` holds the ``apex.*`` modules that have no natural home in amp: the ``apex`` package
itself, ``apex.parallel`` with Apex's modules (``LARC``, ``distributed``, ``multiproc``, ...) and
``apex.multi_tensor_apply`` as the package Apex had; modules of ``apex.amp`` that amp itself lacks
belong in ``apex/amp/``. ``amp_C`` and ``apex_C`` stand in for Apex's compiled extensions where
none is built. Each module re-exports amp's implementations under Apex's names, and adds only the
Apex helpers that amp has no use for; nothing in amp imports this package.
"""
