"""`python -m loadtest ...` is `python -m loadtest.run ...`."""

from loadtest.run import main

main()
