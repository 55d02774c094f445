"""Check a run's communication under NCCL's rules, on the CPU: record it on gloo, replay it as NCCL would run it.

    torchrun --nproc_per_node 3 nccl_rules.py record DIR train_pipeline_afab_manual.py --schedule 1f1b --steps 2
    python nccl_rules.py check DIR        # replayed under NCCL's rules: completes, or each rank's stuck calls

gloo buffers sends, NCCL does not, so an order of sends and receives that completes on gloo can hang on GPUs
(a 2-stage 1F1B whose ranks each send before they receive: NVIDIA/nccl #479, #544). `record` runs a script with
every call of torch.distributed recorded in each rank's issue order (point-to-point calls with their peer, bytes and
process group, which of them form one batch_isend_irecv, collectives with their bytes, reduce op and root, each
wait(), and each point where the host would wait for the GPU), and writes DIR/rankN.json;
`check` replays the ranks' calls under the rules below, twice: with the 2-rank communicators torch makes lazily
for single sends and receives, and with them on the group's own communicator (eager initialization). A recording
is checked for gaps against gloo's flight recorder, which sees every collective issued; one that shows nothing (no
rank, a rank without a call, a rank its groups name without its file) is refused. Used by test_small.py on the
scripts' runs; never imported by a training script.

The rules, as the replay applies them (sources beside each in RULES).
"""

import argparse
import collections
import json
import os
import re
import runpy
import sys
import threading

import torch
import torch.distributed as dist
import torch.distributed.device_mesh

RULES = """\
1. No buffering: a send completes only together with its receive, however small (NCCL User Guide, "Point-to-point
   communication": sends and receives must match, or concurrent ones be in one group call; NCCL completes a send
   without a posted receive only while it fits the peer's buffer, ~1 MB: NVIDIA/nccl #544, #783 "send is allowed
   to block until the corresponding recv"; the replay takes the worst case).
2. Each communicator runs a rank's calls on one CUDA stream, in the order the rank issued them, sends and
   receives alike: a call starts after the one issued before it on that communicator completed
   (ProcessGroupNCCL: one ncclStream per communicator key).
3. Which communicator: a collective, and every call inside a batch_isend_irecv, runs on the group's own
   communicator ("for batch P2P, we need to treat it like a collective when selecting communicator",
   ProcessGroupNCCL::pointToPoint); a single send or receive on a 2-rank communicator per pair of the group,
   made at first contact (getKeySendRecv), or, with eager initialization, on the group's own (pytorch #129147,
   #154132). Both are replayed. A send and a receive meet only on the same communicator, the k-th send from a
   to b with the k-th receive at b from a (no tags in NCCL).
4. A batch_isend_irecv is one NCCL group (ncclGroupStart/End, torch's _coalescing_manager; NCCL User Guide,
   "Group Calls": the operations of a group are launched together, so a send and a receive that need each other
   may both be in it): its calls start together and each completes when its peer's call is running; the batch is
   done when all are.
5. A collective completes when every member of its group is running it, the k-th on that group at each; they
   must agree on what it is, its bytes, reduce op and root (NCCL pairs them by order alone: a mismatch reads or
   writes past a buffer, or hangs). A receive from any source is refused: NCCL has none
   (ProcessGroupNCCL::recvAnysource raises).
6. wait() makes the current CUDA stream wait for the call, and every call issued afterwards waits for the
   current stream first (syncStream): it starts only after each call this thread waited for. The CPU does not
   block in wait() (NCCL) except on a CPU backend's group (gloo, e.g. a background save's), a new group
   (ncclCommSplit is a blocking call over the parent group: new_group, split_group, a DeviceMesh's groups) or a
   barrier (WorkNCCL::synchronize blocks the host for a barrier, then syncs the current stream).
7. The host waits for the GPU where the code reads it: torch.cuda.synchronize (and model.synchronize, the scripts'
   step ends, recorded on the CPU too) waits for every call the rank has issued (cudaDeviceSynchronize: NCCL's
   streams too), Tensor.item() and .tolist() for the current stream, so for the calls waited for before
   (at::cuda::memcpy_and_sync: cudaStreamSynchronize). A send left unwaited across a synchronize completes only
   with its receive: if that receive comes after a call the peer needs from this host, both wait for ever.
"""

# ----------------------------------------------------------------------------------------------------------
# Recording: every ProcessGroup call from Python, the functional collectives (DTensor) and every wait()

_PG_CALLS = {  # ProcessGroup methods torch.distributed's functions call -> what they are
    "send": "send", "recv": "recv", "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "allgather": "all_gather", "allgather_coalesced": "all_gather", "all_gather_single": "all_gather",
    "all_gather_single_coalesced": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "_allgather_base": "all_gather", "reduce_scatter": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter", "broadcast": "broadcast", "barrier": "barrier", "gather": "gather",
    "scatter": "scatter", "reduce": "reduce", "alltoall": "all_to_all", "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all", "recv_anysource": "recv"}
# The argument whose bytes every member of a collective gives alike (rule 5): the first, but a gather's inputs (its
# outputs are the root's alone); an all-to-all's may differ by rank.
_AGREED = {"gather": 1, "all_to_all": None}
_FUNCTIONAL = ("all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
               "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast")
_PROJECT = ("train_pipeline_", "model.py", "checkpoint.py")


def _nbytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors) if isinstance(tensors, (list, tuple)) else 0


def _where() -> str:
    """The innermost frame of the project's files that led to the call: what a deadlock report names."""
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.basename(frame.f_code.co_filename)
        if name.startswith(_PROJECT):
            return f"{name}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "torch"


class Recorder:
    """Records each rank's calls while on (a context manager; on again after off starts a new recording).
    events: [{"op": id, "thread", "kind": send | recv | collective | split, "group", "peer", "bytes", "name",
    "reduce", "root", "batch", "at"}, {"wait": [ids], "thread"} or {"sync": "device" | "stream", "thread", "at"}]
    in issue order; groups: name -> {"ranks", "backend"}."""

    _installed = None

    def __init__(self):
        self.events, self.groups, self.on = [], {}, False
        self._works, self._batches, self._local, self._threads = {}, {}, threading.local(), {}
        self._fr_start, self.gaps, self._lock = {}, [], threading.Lock()
        if Recorder._installed is not None:
            raise RuntimeError("nccl_rules: one Recorder per process")
        Recorder._installed = self
        self._install()

    def __enter__(self):
        self.events, self._works, self._batches, self.on = [], {}, {}, True
        self._fr_start = _flight_recorder_counts()
        return self

    def __exit__(self, *exc):
        self.on = False
        self.gaps = self._gaps()

    def recording(self) -> dict:
        return {"rank": dist.get_rank(), "events": self.events, "groups": self.groups, "gaps": self.gaps}

    # -- what each call adds
    def _thread(self) -> str:
        ident = threading.get_ident()
        if ident == threading.main_thread().ident:
            return "main"
        return self._threads.setdefault(ident, f"thread{len(self._threads) + 1}")

    def _group(self, pg) -> str:
        name = pg.group_name
        if name not in self.groups:
            ranks = dist.get_process_group_ranks(pg)
            self.groups[name] = {"ranks": ranks, "backend": self._backends.get(name, "nccl")}
        return name

    def _op(self, kind: str, pg, work=None, peer=None, nbytes=0, name=None, reduce=None, root=None) -> int | None:
        if not self.on:
            return None
        with self._lock:
            event = {"op": len(self.events), "thread": self._thread(), "kind": kind, "group": self._group(pg),
                     "peer": peer, "bytes": nbytes, "name": name or kind, "reduce": reduce, "root": root,
                     "batch": getattr(self._local, "batch", None), "at": _where()}
            self.events.append(event)
            if work is not None:
                self._works[id(work)] = (work, event["op"])  # the work is kept: its id is not reused
            return event["op"]

    def _wait(self, ops: list) -> None:
        if self.on and ops:
            with self._lock:
                self.events.append({"wait": ops, "thread": self._thread()})

    def _sync(self, kind: str) -> None:
        """A point where the host waits for the GPU (rule 7); one right after another of the thread adds nothing."""
        if self.on:
            with self._lock:
                thread, last = self._thread(), self.events[-1] if self.events else {}
                if last.get("thread") != thread or last.get("sync") not in (kind, "device"):
                    self.events.append({"sync": kind, "thread": thread, "at": _where()})

    def _install(self) -> None:
        recorder, pg_class, work_class = self, dist.ProcessGroup, torch._C._distributed_c10d.Work
        self._backends = {}  # group name -> a backend named at new_group (a CPU group beside NCCL: gloo)

        def pg_call(method, kind, anysource=False):
            def call(pg, *args, **kwargs):
                work = method(pg, *args, **kwargs)
                if kind in ("send", "recv"):  # a receive from any source has no peer: refused by the replay
                    peer = None if anysource else dist.get_global_rank(pg, args[1])
                    recorder._op(kind, pg, work, peer, _nbytes(args[0]))
                    return work
                agreed = _AGREED.get(kind, 0)
                opts = next((a for a in (*args, *kwargs.values()) if hasattr(a, "reduceOp") or hasattr(a, "rootRank")),
                            None)
                reduce = str(opts.reduceOp.op).split(".")[-1].lower() if hasattr(opts, "reduceOp") else None
                recorder._op("collective", pg, work, nbytes=None if agreed is None or len(args) <= agreed else
                             _nbytes(args[agreed]), name=kind, reduce=reduce, root=getattr(opts, "rootRank", None))
                return work
            return call

        for method, kind in _PG_CALLS.items():
            if hasattr(pg_class, method):
                setattr(pg_class, method, pg_call(getattr(pg_class, method), kind, method == "recv_anysource"))

        original_wait = work_class.wait

        def wait(work, *args, **kwargs):
            entry = recorder._works.get(id(work))
            if entry is not None and entry[0] is work:
                recorder._wait(recorder._batches.get(entry[1], [entry[1]]))
            return original_wait(work, *args, **kwargs)
        work_class.wait = wait

        # A batch: its calls form one NCCL group. On gloo batch_isend_irecv issues them one by one (one work each);
        # under NCCL the batch has one work, so waiting for any of them is waiting for the batch.
        original_batch = dist.distributed_c10d.batch_isend_irecv

        def batch_isend_irecv(p2p_op_list):
            if not recorder.on:
                return original_batch(p2p_op_list)
            recorder._local.batch = f"{threading.get_ident()}:{len(recorder.events)}"
            try:
                works = original_batch(p2p_op_list)
            finally:
                batch, recorder._local.batch = recorder._local.batch, None
            ops = [e["op"] for e in recorder.events if "op" in e and e["batch"] == batch]
            for op in ops:
                recorder._batches[op] = ops
            return works
        for module in (dist, dist.distributed_c10d):
            module.batch_isend_irecv = batch_isend_irecv

        # New groups: each a blocking call of every rank of its parent (ncclCommSplit), recorded on the parent.
        # DeviceMesh imports new_group and split_group by name: its module's are replaced too.
        original_new_group, original_split = dist.distributed_c10d.new_group, dist.distributed_c10d.split_group

        def made(group, parent, backend=None):
            member = group is not None and group != dist.GroupMember.NON_GROUP_MEMBER
            if member and backend:
                recorder._backends[group.group_name] = str(backend).lower()
            if parent is not None:
                op = recorder._op("split", parent)
                recorder._wait([op] if op is not None else [])
            return group

        def new_group(*args, **kwargs):
            group = original_new_group(*args, **kwargs)
            local = kwargs.get("use_local_synchronization") and group != dist.GroupMember.NON_GROUP_MEMBER
            return made(group, group if local else dist.distributed_c10d._get_default_group(), kwargs.get("backend"))

        def split_group(*args, **kwargs):
            group = original_split(*args, **kwargs)
            parent = kwargs.get("parent_pg", args[0] if args else None)
            return made(group, parent or dist.distributed_c10d._get_default_group(), kwargs.get("backend"))
        for module in (dist, dist.distributed_c10d, torch.distributed.device_mesh):
            for name, function in (("new_group", new_group), ("split_group", split_group)):
                if hasattr(module, name):
                    setattr(module, name, function)

        # Where the host waits for the GPU (rule 7). The scripts' step ends call model.synchronize, which on the
        # CPU waits for nothing and is recorded all the same; a script imports it by name, so each module that
        # holds it gets the recording one (import this after the script's folder is on sys.path: record_script).
        def synced(function, kind):
            def call(*args, **kwargs):
                recorder._sync(kind)
                return function(*args, **kwargs)
            return call
        torch.cuda.synchronize = synced(torch.cuda.synchronize, "device")
        torch.Tensor.item, torch.Tensor.tolist = synced(torch.Tensor.item, "stream"), synced(torch.Tensor.tolist,
                                                                                             "stream")
        try:
            import model
        except ImportError:  # a script of another collection: its own synchronize, if any, is not seen
            model = None
        original_sync = getattr(model, "synchronize", None)
        if original_sync is not None:
            recording_sync = synced(original_sync, "device")
            for module in list(sys.modules.values()):
                if getattr(module, "synchronize", None) is original_sync:
                    module.synchronize = recording_sync

        # DTensor's collectives (tensor parallelism, loss_parallel) go to C++ ops that never reach ProcessGroup's
        # Python methods: recorded at the op, as waited at once (DTensor waits before it uses the result).
        namespace = torch.ops._c10d_functional
        for name in _FUNCTIONAL:
            setattr(namespace, name, _Functional(getattr(namespace, name), name, self))

    def _gaps(self) -> list[str]:
        """Groups whose collectives gloo's flight recorder saw more (or fewer) of than were recorded."""
        seen = _flight_recorder_counts()
        recorded = collections.Counter(e["group"] for e in self.events if e.get("kind") == "collective")
        return [f"group {name}: {seen.get(name, 0) - self._fr_start.get(name, 0)} collectives issued, "
                f"{recorded.get(name, 0)} recorded" for name in sorted(set(seen) | set(recorded))
                if seen.get(name, 0) - self._fr_start.get(name, 0) != recorded.get(name, 0)]


class _Functional:
    """A functional collective op (torch.ops._c10d_functional.NAME) that records each call."""

    def __init__(self, op, name: str, recorder: Recorder):
        self._op, self._name, self._recorder = op, name, recorder

    def __call__(self, *args, **kwargs):
        group_name = args[-1] if isinstance(args[-1], str) else kwargs.get("group_name")
        pg = dist.distributed_c10d._resolve_process_group(group_name)
        reduce = args[1].lower() if "reduce" in self._name else None  # all_reduce(input, op, ...), reduce_scatter
        root = args[1] if self._name == "broadcast" else None  # broadcast(input, src, ...)
        op = self._recorder._op("collective", pg, nbytes=None if self._name == "all_to_all_single" else
                                _nbytes(args[0]), name=self._name.split("_into")[0], reduce=reduce, root=root)
        result = self._op(*args, **kwargs)
        self._recorder._wait([op] if op is not None else [])
        return result

    def __getattr__(self, name):
        return getattr(self._op, name)


def _flight_recorder_counts() -> dict:
    """How many collectives gloo's flight recorder (TORCH_FR_BUFFER_SIZE) holds per group name; {} when it is
    off. gloo records collectives there, not point-to-point calls."""
    try:
        import pickle
        entries = pickle.loads(torch._C._distributed_c10d._dump_fr_trace()).get("entries", [])
    except Exception:  # not available, or no group yet
        return {}
    return dict(collections.Counter(e["process_group"][0] for e in entries))


# ----------------------------------------------------------------------------------------------------------
# Replay

class Deadlock(Exception):
    pass


def replay(recordings: list[dict], eager: bool = False) -> None:
    """Run the ranks' recorded calls under NCCL's rules (RULES); raise Deadlock naming each rank's stuck calls,
    or ValueError for calls NCCL would pair that do not match (two collectives, or a send and a receive, of
    another size, reduce op or root) and for a receive from any source. eager: single sends and receives on the
    group's own communicator, else on one made per pair."""
    groups, calls, threads = {}, {}, collections.defaultdict(list)  # (rank, thread) -> its events, in order
    for recording in recordings:
        groups.update(recording["groups"])
    for recording in recordings:
        rank, made = recording["rank"], set()
        for event in recording["events"]:
            if "wait" in event or "sync" in event:
                threads[rank, event["thread"]].append(event)
                continue
            if event["kind"] == "recv" and event["peer"] is None:
                raise ValueError(f"rank {rank}: a receive from any source at {event['at']}: NCCL has none "
                                 "(ProcessGroupNCCL::recvAnysource raises); name the peer")
            call = dict(event, rank=rank, done=False, members=groups[event["group"]]["ranks"])
            single = call["kind"] in ("send", "recv") and call["batch"] is None
            call["cpu"] = groups[call["group"]]["backend"] != "nccl" or call["kind"] == "split"  # rule 6
            call["comm"] = (call["group"], "split") if call["kind"] == "split" else \
                (call["group"], *sorted((rank, call["peer"]))) if single and not eager else (call["group"],)
            if len(call["comm"]) == 3 and call["comm"] not in made:  # rule 3: a pair's communicator is made at
                made.add(call["comm"])  # its first call, by both ranks: a blocking call of the two (Megatron #5240)
                init = dict(call, op=f"init {call['op']}", kind="init", name="a 2-rank communicator's creation",
                            comm=call["comm"] + ("init",), members=list(call["comm"][1:]), cpu=True, bytes=0)
                calls[rank, init["op"]] = init
                threads[rank, event["thread"]] += [{"op": init["op"]}, {"wait": [init["op"]]}]
            calls[rank, call["op"]] = call
            threads[rank, event["thread"]].append(event)
    # Whom a call meets (rules 3, 5): the k-th send from a to b on a communicator with the k-th receive at b from
    # a on it; the k-th collective on a communicator with every member's k-th.
    counter, meets = collections.Counter(), collections.defaultdict(list)
    for (rank, _), call in calls.items():
        ends = (rank, call["peer"]) if call["kind"] == "send" else (call["peer"], rank)
        key = (call["comm"], *ends) if call["kind"] in ("send", "recv") else call["comm"]
        counter[rank, key] += 1
        call["meets"] = (key, counter[rank, key])
        meets[call["meets"]].append(call)
    for matched in meets.values():
        _check_match(matched)

    # Each communicator's stream: the rank's calls on it in the order they were issued, a batch's as one entry
    # (rule 4). A call starts once it heads its stream, its thread has issued it, and what that thread had waited
    # for by then is complete (rule 6); threads issue up to a wait that blocks the CPU.
    streams = collections.defaultdict(collections.deque)  # (rank, comm) -> [a call] or [a batch's calls]
    for call in calls.values():
        queue = streams[call["rank"], call["comm"]]
        if call["batch"] is not None and queue and queue[-1][-1]["batch"] == call["batch"]:
            queue[-1].append(call)
        else:
            queue.append([call])
    position = {key: 0 for key in threads}  # (rank, thread) -> the next event to issue
    waited = collections.defaultdict(list)  # (rank, thread) -> calls waited for, not known complete at the time
    issued = collections.defaultdict(list)  # rank -> its calls issued so far, by any thread
    host = {}  # (rank, thread) -> what its host waits for, where it blocks (rules 6, 7)

    def issue(key) -> bool:
        rank, events, moved = key[0], threads[key], False
        while position[key] < len(events):
            event = events[position[key]]
            waited[key] = [c for c in waited[key] if not c["done"]]
            if "sync" in event:  # rule 7: at its first visit, what the host waits for from then on
                if key not in host:
                    host[key] = (event, [c for c in issued[rank] if not c["done"] and not c["cpu"]]
                                 if event["sync"] == "device" else list(waited[key]))
                if any(not c["done"] for c in host[key][1]):
                    return moved
            elif "wait" in event:
                pending = [calls[rank, op] for op in event["wait"] if not calls[rank, op]["done"]]
                if key not in host:
                    barrier = any(c["name"] == "barrier" and not c["cpu"] for c in pending)  # and a stream's sync
                    host[key] = (event, pending + waited[key] if barrier else [c for c in pending if c["cpu"]])
                if any(not c["done"] for c in host[key][1]):
                    return moved  # the CPU blocks here until they complete (rule 6)
                waited[key] += pending
            else:
                call = calls[rank, event["op"]]
                call["after"] = list(waited[key])
                issued[rank].append(call)
            host.pop(key, None)
            position[key] += 1
            moved = True
        return moved

    def running(call) -> bool:  # at the head of its stream, issued, what it was issued after complete
        queue = streams[call["rank"], call["comm"]]
        return bool(queue) and any(c is call for c in queue[0]) and all(
            "after" in c and all(d["done"] for d in c["after"]) for c in queue[0])

    progress = True
    while progress:
        progress = any([issue(key) for key in threads])
        for queue in list(streams.values()):
            for call in queue[0] if queue else ():
                others = [c for c in meets[call["meets"]] if c is not call]
                if call["done"] or not running(call) or len(others) != len(
                        [1] if call["kind"] in ("send", "recv") else call["members"][1:]):
                    continue  # rules 1 and 5: with its peer's call, or every member's, or not at all
                if all(running(c) for c in others):
                    for c in [call, *others]:
                        c["done"] = True
                    progress = True
        for queue in streams.values():
            while queue and all(c["done"] for c in queue[0]):
                queue.popleft()
    if any(not call["done"] for call in calls.values()) or any(position[k] < len(threads[k]) for k in threads):
        raise Deadlock(describe(streams, eager, host))


def _check_match(matched: list) -> None:
    kinds = {"p2p" if c["kind"] in ("send", "recv") else c["name"] for c in matched}
    if len(kinds) > 1:
        raise ValueError(f"calls that NCCL would pair do not match: {_show(matched)}")
    if len(matched) == 2 and kinds == {"p2p"} and matched[0]["bytes"] != matched[1]["bytes"]:
        raise ValueError(f"a send and its receive differ in size: {_show(matched)}")
    if kinds != {"p2p"}:  # rule 5: a collective's members agree on its size (where they must), reduce op and root
        for what, key in (("size", "bytes"), ("reduce op", "reduce"), ("root", "root")):
            if len({c.get(key) for c in matched if not (key == "bytes" and c.get(key) is None)}) > 1:
                raise ValueError(f"members of a collective differ in {what}: {_show(matched)}")


def _show(calls) -> str:
    return "; ".join(f"rank {c['rank']}: {_name(c)}" for c in calls)


def _name(call) -> str:
    what = {"send": f"send to {call['peer']}", "recv": f"recv from {call['peer']}"}.get(call["kind"], call["name"])
    what += "".join(f" {label}{call[key]}" for label, key in (("", "reduce"), ("root ", "root"))
                    if call.get(key) is not None)
    batch = " (in a batch)" if call["batch"] is not None else ""
    size = "" if call.get("bytes") is None else f" of {call['bytes']} bytes"
    return f"{what}{size} on group {call['group']}{batch} at {call['at']}"


def describe(streams: dict, eager: bool, host: dict | None = None) -> str:
    """Each rank's calls that cannot go on: the head of each of its streams, and each host that waits."""
    lines = [f"deadlock under NCCL's rules ({'eager' if eager else 'lazy'} communicators for single sends):"]
    for (rank, thread), (event, blocking) in sorted((host or {}).items()):
        left = [c for c in blocking if not c["done"]]
        where = f"a {event['sync']} synchronize at {event['at']}" if "sync" in event else "a blocking wait"
        lines.append(f"  rank {rank}, host ({thread}): waits at {where} for " + "; ".join(map(_name, left[:3]))
                     + (f" and {len(left) - 3} more" if len(left) > 3 else ""))
    for (rank, comm), queue in sorted(streams.items(), key=lambda item: str(item[0])):
        if queue:
            blocked = "" if all("after" in c and all(d["done"] for d in c["after"]) for c in queue[0]) else \
                " (not issued yet, or after a call it waited for)"
            lines.append(f"  rank {rank}, communicator {'/'.join(map(str, comm))}: "
                         + " + ".join(_name(c) for c in queue[0] if not c["done"]) + blocked)
    return "\n".join(lines)


def check(recordings: list[dict]) -> None:
    """Replay under both communicator choices (rule 3). Refused: a recording with gaps, none at all, a rank without
    a call (nothing recorded there passes by itself), or one without the recording of every rank its groups name."""
    if not recordings:
        raise ValueError("no rank's recording to check")
    gaps = [f"rank {r['rank']}: {gap}" for r in recordings for gap in r.get("gaps", [])]
    if gaps:
        raise ValueError("the recording missed calls: " + "; ".join(gaps))
    if empty := [r["rank"] for r in recordings if not any("op" in e for e in r["events"])]:
        raise ValueError(f"rank {', '.join(map(str, empty))} recorded no call; record a run that communicates")
    named = {rank for r in recordings for group in r["groups"].values() for rank in group["ranks"]}
    if missing := sorted(named - {r["rank"] for r in recordings}):
        raise ValueError(f"no recording of rank {', '.join(map(str, missing))}, which the groups hold; check the "
                         "directory of a whole run")
    for eager in (False, True):
        replay(recordings, eager)


# ----------------------------------------------------------------------------------------------------------
# The command line

def load(directory: str) -> list[dict]:
    """DIR/rankN.json, in the order of N."""
    names = [f for f in os.listdir(directory) if re.fullmatch(r"rank\d+\.json", f)]
    return [json.load(open(os.path.join(directory, name))) for name in sorted(names, key=lambda f: int(f[4:-5]))]


def record_script(directory: str, script: str, argv: list[str]) -> None:
    """Run script as `python script argv` would, recording this rank's calls into directory/rankN.json."""
    if not os.path.isfile(script):
        _fail(f"{script}: no such script; give the training script to run, then its flags")
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "1000000")  # gloo's flight recorder: the check for gaps
    sys.argv, sys.path[0] = [script, *argv], os.path.dirname(os.path.abspath(script))
    recorder = Recorder()  # after: it takes the script's own model.py (its synchronize)
    try:
        with recorder:
            runpy.run_path(script, run_name="__main__")
    finally:  # also when the script exits (its status, sys.exit) or fails
        save(recorder, directory)


def save(recorder: Recorder, directory: str) -> None:
    """Write a recording as directory/rankN.json (N: torchrun's RANK)."""
    os.makedirs(directory, exist_ok=True)
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "events": recorder.events, "groups": recorder.groups, "gaps": recorder.gaps}, f)


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=RULES)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="run a script (under torchrun), recording each rank's calls into DIR")
    r.add_argument("directory", metavar="DIR")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    c = sub.add_parser("check", help="replay DIR's recording under NCCL's rules")
    c.add_argument("directory", metavar="DIR")
    args = p.parse_args(argv)
    if args.command == "record":
        return record_script(args.directory, args.script, args.args)
    try:
        recordings = load(args.directory)
    except (OSError, ValueError) as e:
        _fail(f"{args.directory}: not a recording of nccl_rules.py record ({e})")
    if not recordings:
        _fail(f"{args.directory} holds no rankN.json; record a run into it first")
    try:
        check(recordings)
    except (Deadlock, ValueError) as e:
        _fail(str(e))
    calls = sum("op" in e for r in recordings for e in r["events"])
    print(f"{len(recordings)} ranks, {calls} calls: complete under NCCL's rules (lazy and eager communicators)")


if __name__ == "__main__":
    main()
