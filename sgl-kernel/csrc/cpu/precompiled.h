// The headers every kernel source parses, precompiled once per build (setup.py): no source includes
// this file; setup.py force-includes it (-include) in every source of sgl_kernel._cpu. Parsing
// ATen/ATen.h is ~10 CPU s per source on the CI machine, most of a light kernel's compile time.
// Where the precompiled copy is stale or was built with other flags, GCC parses this header
// instead (-Winvalid-pch says so): the build is slower, never different.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
