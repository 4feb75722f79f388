"""``make test-suites``: the frameworks' own test files, run plain and with our plugins injected.

Not part of ``make test`` (``testpaths`` is ``tests/``). ``inject`` is the pytest plugin loaded into every run
(``-p peer_suites.inject``), ``report`` parses the JUnit XML and tags each failure, ``run`` drives the runs
and writes the table, ``script`` runs Accelerate's checkpointing script on two processes. See
``docs/test-suites.md``.
"""
