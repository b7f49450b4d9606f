#!/usr/bin/env bash
# The main job: train a model with DDP on CPU, checkpoint it, and resume it with the upstream Trainer and with
# serialized_checkpoint_loading=True, printing the node's peak memory for each. Arguments go to demo/demo.py.
source "$(dirname "$0")/env.sh"
exec python demo/demo.py "$@"
