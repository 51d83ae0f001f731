__version__ = "0.1.0"

# The fairscale release whose OSS / ShardedDataParallel / AsyncPipe API and results decentpy
# follows (its benchmarks and the fairscale test harness in tools/ compare against this one).
FAIRSCALE_VERSION = "0.4.13"
