"""The ruler: what a model costs (cost.py), what hardware offers (hardware.py, probe.py, resolve.py),
what a serving shape will take (plan.py) and how close a run came (meter.py, an observer of the
engine's steps). harness.py is the one place perf builds an engine. docs/ruler.md defines every
figure."""
