"""Tools over the kdajit kernel cache, behind the `kdajit` command (`kdajit.cli`).

- `store`: walking a cache root (entries, toolchain dirs, sizes, safe removal)
- `keyspec`: command-line words to kernel keys (precompile's cross product, `why`'s key syntax)
- `precompile`: compiling keys into the cache with a pool of GPU-blind worker processes
- `inspection`: `cache ls | show | why | verify`
- `maintenance`: `cache prune | clear`
- `bundle`: `cache export | import`
- `envinfo`: `kdajit env`
"""
