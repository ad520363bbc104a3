// Package integration runs the real govirtiofsd binary (built with -race) as
// a separate process and drives it through test/vmm, which plays QEMU 7.2
// and the Linux virtio-fs driver over a real unix socket.
//
// Every test starts its own daemon on a fresh shared directory and ends by
// disconnecting; the daemon must then exit with status 0 within two
// seconds, with no data race report and no panic in its log.
//
// The tests need root (the passthrough file system switches credentials).
//
// The tests, by file: negotiation_test.go (features, queue count, config,
// status, older front ends), messages_test.go (every message id, resets,
// fds of refused messages, NOFD kick/call), roundtrip_test.go (ring sizes,
// chain shapes, memory layouts, multiqueue), stoprestart_test.go (exact
// pause/resume with requests in flight, guest reset), memory_test.go
// (regions across restarts, hotplug, call fd swaps, a shrunk memfd),
// disconnect_test.go, malformed_ring_test.go (split and packed rings) and
// malformed_msg_test.go.
//
// Knobs:
//
//	GOVIRTIOFSD_STRESS_ITER=N   stop/restart iterations (default 1000)
//	GOVIRTIOFSD_KNOWN_BUGS=1    run the tests of known, not yet fixed daemon bugs
//	GOVIRTIOFSD_TEST_LOG=1      log every daemon's whole stderr
//	GOVIRTIOFSD_INTEGRATION_RINGS=packed
//	                            every device requires packed virtqueues
//	                            (make integration-sandbox runs the ring
//	                            tests so: PACKED_RING_TESTS in the Makefile)
//	GOVIRTIOFSD_INTEGRATION_SHARE=overlay-budget
//	                            every share is an overlayfs (no nfs_export)
//	                            served with --inode-fd-budget 16 (make
//	                            integration-sandbox runs BUDGET_TESTS so)
package integration
