"""Offline throughput benchmark; see `python -m radixserve.bench_offline_throughput --help`."""

from radixserve.bench_offline_throughput import main

if __name__ == "__main__":
    main()
