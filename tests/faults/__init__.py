"""The tests' fault injection, kept out of the package: `inject` holds the rules, and
`sitecustomize` applies them in the processes the tests start (this folder on their PYTHONPATH)."""
