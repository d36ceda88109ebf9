"""The ruler: what a model costs (cost.py), what hardware offers (hardware.py, probe.py), what a
serving shape will take (plan.py) and how close a run came (meter.py). docs/ruler.md defines every
figure."""
