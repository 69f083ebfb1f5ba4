"""`serve`: a long-lived parameter-server job that takes one checkpoint after another.

Its modules (each docstring says its part): control.py, control_client.py, commands.py,
loop.py, state.py, push.py, run.py. Nothing is imported here: the clients
(ckptctl.serve.control_client) import control.py alone, and start fast.
"""
