"""Where and how the process runs: device, threads, seeding, process group, precision, signals."""

from .accel import (AccelConfigError, apply_activation_checkpointing, channels_last_breaks, checkpointing_line,
                    compile_line, compile_models, configure_backends, tf32_in_force, wants_channels_last)
from .device import RuntimeSetupError, configure_threads, select_device
from .dist import (DistInfo, DistributedError, agree_max, all_reduce_max, all_reduce_mean, all_reduce_sum, barrier, broadcast,
                   collective_error, destroy_process_group, detect, explain_collective_errors, gather,
                   gather_to_first, get_rank, get_world_size, Groups, host_collectives, init_process_group,
                   is_initialized, is_main_process, restart_count, WORLD, all_gather_numbers, enter_collective,
                   leave_collective, peer_lost, backend_name)
from .hang import EXIT_HANG, HangWatch, Progress, default_store
from .precision import Precision, make_precision
from .seed import rng_state, rng_states_of_ranks, seed_everything, set_rng_state
from .signals import RunStopped, StopSignal, requeue_slurm_job, signal_name, stop_phase
from .modules import local_tensor, unwrap
from .notebook import RunInterrupted, as_notebook_stop, in_jupyter_kernel

__all__ = [
    "RuntimeSetupError", "configure_backends", "configure_threads", "select_device", "DistInfo",
    "DistributedError", "agree_max", "all_reduce_max", "collective_error", "restart_count", "is_initialized",
    "all_reduce_mean", "all_reduce_sum", "barrier", "broadcast", "destroy_process_group", "detect",
    "gather", "get_rank", "get_world_size", "host_collectives", "init_process_group", "is_main_process", "Precision",
    "make_precision", "rng_state", "rng_states_of_ranks", "seed_everything", "set_rng_state",
    "unwrap", "local_tensor", "explain_collective_errors", "RunStopped", "StopSignal", "requeue_slurm_job",
    "signal_name", "stop_phase", "Groups", "WORLD", "gather_to_first", "RunInterrupted", "as_notebook_stop", "in_jupyter_kernel",
    "AccelConfigError", "apply_activation_checkpointing", "checkpointing_line", "compile_line", "compile_models", "wants_channels_last", "tf32_in_force",
    "channels_last_breaks", "all_gather_numbers", "enter_collective", "leave_collective", "peer_lost", "EXIT_HANG",
    "HangWatch", "Progress", "backend_name", "default_store",
]
