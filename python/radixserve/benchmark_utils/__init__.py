"""Building blocks of `radixserve.bench_serving`: datasets, request backends and metric arithmetic."""
