"""The version matrix's code, one module per job; ``scripts/matrix.py`` is its command line.

* :mod:`.cells`: the cells (``Cell``, ``CELLS``), where they live and how each is built;
* :mod:`.runs`: a cell's suite and doctor, and the loop that builds and runs the cells;
* :mod:`.lock`: a cell's constraints file, its top pins re-resolved into full pins;
* :mod:`.gates`: the gate check, every patch's doctor verdict in every cell against its version gate;
* :mod:`.table`: the README's compatibility table and docs/testing.md's matrix of cells, rendered from
  the reports, read and rewritten;
* :mod:`.measured`: the oldest and newest release measured per distribution, ``shim/measured.json``.

``cells`` imports none of the others; ``runs``, ``lock`` and ``gates`` import only ``cells``;
``table`` and ``measured`` import ``cells`` and ``gates``. Standard library only, python3 >= 3.10: the matrix
starts before any environment exists.
"""
