"""Static-batch benchmark; see `python -m radixserve.bench_one_batch --help`."""

from radixserve.bench_one_batch import main

if __name__ == "__main__":
    main()
