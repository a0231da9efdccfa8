"""kit.py's parts, one job a module: venv.py (the repository's .venv, set up from the package index, and the
environment the tests run in), wheels.py (the wheels a lent GPU machine without a package index installs from),
colab.py (the notebooks' install cell and the README's Colab links), gpucheck.py (`kit.py gpu-check`). Standard
library only: kit.py runs them on a fresh machine that has nothing but Python."""
