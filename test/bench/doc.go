// Package bench is the side-by-side benchmark of govirtiofsd, the
// reference C virtiofsd and the Rust virtiofsd 1.13 (make bench; the
// command is test/bench/cmd; the Rust daemon comes from make test-deps).
//
// Each daemon configuration (ours by default, ours with 2 request rings,
// ours and the reference with --thread-pool-size 0/1/2, the Rust daemon
// with --thread-pool-size 0 and 2 in its default sandbox) is started in
// turn on a tmpfs share with cache=none, a fresh daemon per run, the
// configurations interleaved per workload and the whole set repeated for
// a few rounds, each starting one configuration later than the last (the
// median is reported, and beside it the median of each round's ratio of
// ours to the best reference: pairedRatio). test/vmm plays QEMU:
// Device.Start with the real start-up message flow, INIT, LOOKUP and OPEN
// of the data files through a vmm.Session. Then TakeoverAll replays a VM
// pause and resume (GET_VRING_BASE, then NUM/BASE/ADDR/KICK/ENABLE/CALL at
// the same base) to hand every ring to a Ring with its own kick and call
// eventfds, and one goroutine per ring (locked to its thread, as a vCPU)
// keeps the requests in flight (for the Rust daemon SET_VRING_ENABLE waits
// for its ack, as in QEMU >= 8.1: it drops a kick that beats the enable):
//
//   - requests are laid out once per slot the way Linux's virtio_fs does
//     (in header, in args, one descriptor per 4 KiB data page, out header,
//     out args; one indirect descriptor), data pages shuffled so that no
//     two consecutive segments are adjacent in guest memory; a request
//     costs the front end a few stores (unique, node id, fh, offset);
//   - completions are reaped as they come and the freed slots resubmitted
//     at once; kicks follow vring_need_event on avail_event (one decision
//     per batch); the goroutine sleeps in read(2) on the call eventfd after
//     setting used_event to the last seen index, as virtqueue_enable_cb;
//   - nothing allocates on that path (TestNullDevice checks it), and an
//     in-process null device (bench -null) measures the front end alone.
//
// A watchdog counts stalls: one sleep of half a second or more although
// the awaited completions are in the used ring, split into notification
// withheld by the daemon (call eventfd not signalled, thread still in
// read) and front end not scheduled (eventfd signalled). It never wakes
// the front end itself; a daemon that loses a notification for good, or
// stops serving, makes the run fail after 15 s with the rings' state as
// both sides saw it.
//
// bench -profile DIR writes a Go CPU profile of our daemon per run
// (GOVIRTIOFSD_CPUPROFILE, read by go tool pprof); our daemon then runs
// with --seccomp none, as the profiler's timers are outside the allowlist.
//
// Each round also measures the machine's ceiling for the 1 MiB workloads
// (ceiling.go; -ceiling=false skips it): the daemon's own system call, one
// pwritev or preadv of 256 4-KiB segments of a shared mapping laid out like
// the front end's buffers, on the same data files, from 1 thread and from
// one per CPU, with no front end and no daemon. Each configuration's rate
// is then also given as a share of it: on a machine with few CPUs a 1 MiB
// request is mostly the kernel's copy, so the share says how much of what
// the machine allows a daemon delivers, and the ceiling's own swings from
// round to round show how noisy the machine was.
//
// Per run it reports throughput, p50/p99 latency (submission to reap), the
// CPU used by the daemon, the front end and everything else on the
// machine (/proc/stat), kicks and sleeps per request; and per daemon the
// RssAnon summed over its processes, idle after INIT and after a 1 MiB
// write run at depth 64.
//
// The scale run (scale.go; make bench-scale, part of make bench) asks
// another question: what a daemon holds for a large tree the guest keeps
// looked up. Every directory and file of a share of N empty files (tmpfs,
// ext4 on a loop image, overlayfs without nfs_export) is LOOKed UP and
// kept, then some are OPENed; per daemon it reports descriptors, memory
// and slab per inode, LOOKUPs per second and errors by errno.
package bench
