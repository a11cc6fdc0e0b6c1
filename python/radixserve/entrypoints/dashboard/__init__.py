"""The live dashboard at /dashboard: static files shipped in the package (static/) and the one
JSON document they poll (/dashboard/state). docs/observability.md describes it."""
