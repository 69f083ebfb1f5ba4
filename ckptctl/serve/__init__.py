"""`serve`: a long-lived parameter-server job that takes one checkpoint after another.

- control.py: the control socket, the one part other users can reach (where it lives, who
  may talk to it, the bounded HTTP it speaks); its client half is ckptctl.serve.control_client;
- commands.py: commands from rank 0 to every rank over the job's own gloo group - never
  through torchrun's store, which anyone who reaches the node can write to;
- loop.py: the loop every rank runs, and what `status` shows;
- state.py: what the job keeps between pushes (ServeState);
- push.py: one push (the stages of `update`) and how it fails without ending the job;
- run.py: the real job (a ParameterServer per rank).

Nothing is imported here: the clients (ckptctl.serve.control_client) import control.py alone, and
start fast.
"""
