"""The modules of Apex's ``apex.amp`` that amp itself has no module of that name for.

``apex.amp`` is amp itself (``apex.amp is amp``), and ``apex.amp.handle``, ``.frontend``,
``.scaler``, ``._amp_state`` and ``._initialize`` are amp's own modules; the rest of Apex's
``apex/amp`` (``amp``, ``compat``, ``lists``, ``opt``, ``rnn_compat``, ``utils``, ``wrap``,
``_process_optimizer``, ``__version__``) is here, each holding the names Apex's module held, on
top of amp. The switch's finder serves them; this package itself is never ``apex.amp``.
"""
