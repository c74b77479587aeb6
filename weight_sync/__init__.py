"""Trainer-side live weight sync: the update group, the bucketed sender, and the weight fingerprint."""

from weight_sync.fingerprint import fingerprint
from weight_sync.group import destroy_process_group, init_process_group
from weight_sync.sender import SyncReport, WeightSender, plan_buckets

__all__ = ["init_process_group", "destroy_process_group", "fingerprint", "WeightSender", "SyncReport",
           "plan_buckets"]
