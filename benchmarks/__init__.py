"""Benchmarks of transformer_fast (DESIGN section 8): ``python -m benchmarks --help``.

Above the package: this folder imports transformer_fast, never the other way round.

    common.py   timing, peaks, memory, errors, rows, output (json / markdown / plots)
    ops.py      per-op sweeps through the functional API, one provider = one backend
    models.py   end to end: encoder/decoder layers, a training step, greedy decoding
    __main__.py the command line
"""
