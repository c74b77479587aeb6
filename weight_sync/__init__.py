"""Trainer-side live weight sync: the update group, the bucketed sender, and the weight fingerprint.

The engine side lives in ``rollout.weights``; the group and the fingerprint are the same code on both sides.
"""

from rollout.weights.fingerprint import fingerprint
from rollout.weights.group import destroy_process_group, init_process_group
from weight_sync.handshake import join_engines, leave_engines
from weight_sync.sender import SyncReport, WeightSender, plan_buckets

__all__ = ["init_process_group", "destroy_process_group", "join_engines", "leave_engines", "fingerprint",
           "WeightSender", "SyncReport", "plan_buckets"]
