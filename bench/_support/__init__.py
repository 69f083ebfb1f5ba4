"""What the benchmarks and the tests both use: checkpoint factories (ckpt_factory), real models'
tensor shapes (model_shapes), ports and the torchrun command line (torchrun_launch).

The benchmarks, run as `python bench/NAME.py`, import it as the package `_support` (bench/ is
their script folder); tests/conftest.py puts this folder on the tests' path, where the modules
keep their own names (`import ckpt_factory`)."""
