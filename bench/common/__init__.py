"""What the benchmarks share, with public names (import the modules, ``bench.common.tables``...):

* ``launch``      spawning a worker group (over :mod:`tools.spawn`) and the shared timing options;
* ``measure``     step-time and memory measurement in the workers (Config, Runner, ...);
* ``models``      the models, data and optimizer of bench_train, bench_shard and bench_hybrid;
* ``tables``      report tables, cell formats, CSV files;
* ``plots``       optional matplotlib, saved alike;
* ``machine``     the ``machine:`` line and the CSVs' machine fields;
* ``references``  whether fairscale, the reference of several benchmarks, is there.
"""
