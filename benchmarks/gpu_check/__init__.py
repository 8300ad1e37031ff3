"""The GPU check (benchmarks/gpu_check.sh): one module per section, run by a worker under an orchestrator.

    __main__.py   the orchestrator: global deadline, worker restarts, summary.md / summary.json / logs.tgz
    worker.py     runs sections in one process and reports each to the orchestrator
    summary.py    the record (standard library only)
    context.py    what sections share: device, sizes per mode, deadline, logs, commands, memory statistics
    a_env.py  b_train.py  c_parity.py  d_lossless.py  e_shapes.py  f_engine.py  g_launchers.py   sections A-G
    stage_wheels.sh   the wheels a bare GPU machine lacks, into .whl/
"""
