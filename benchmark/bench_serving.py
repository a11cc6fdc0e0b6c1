"""Online serving benchmark; see `python -m radixserve.bench_serving --help`."""

from radixserve.bench_serving import main

if __name__ == "__main__":
    main()
