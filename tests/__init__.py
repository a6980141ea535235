"""The test suite. A package, so that pytest puts the repository root (not tests/) on sys.path and
`registry`, `router`, ... always mean the project's packages, never the test folders of that name."""
