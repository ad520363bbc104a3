# govirtiofsd — build, test and benchmark targets.
#
#   make            make deps, then the static daemon at bin/govirtiofsd
#   make deps       Debian packages the build and the tests need (root)
#   make test-deps  deps, then the peers the tests also run against, fetched
#                   into .cache/peers without touching the system (test/peers.sh:
#                   QEMU 10.x from bookworm-backports, QEMU 11.x from sid with
#                   its library closure, the Rust virtiofsd 1.13.x from trixie
#                   and 1.14.x from sid, private apt state; ~40 s and ~410 MB
#                   once, then a stamp check). Wrappers: .cache/peers/bin/
#                   qemu-system-x86_64-10, qemu-system-x86_64-11, virtiofsd-rust
#                   and virtiofsd-rust-1.14. A prerequisite of test, e2e,
#                   e2e-full, bench, bench-guest and soak (not of make/build);
#                   PEERS_REFRESH=1 asks the mirror again for newer point releases
#   make test       everything CI runs: vet, unit + integration (-race,
#                   --sandbox none), integration against the static daemon
#                   in its default sandbox (and the escape tests in chroot),
#                   each fuzz target briefly, one guest boot per kernel,
#                   a 20,000-file walk from a guest (TestGuestWalk), and
#                   Linux 7.x under QEMU 11 (TestQEMU11: boot/reboot/power-off,
#                   POSIX beside the Rust virtiofsd 1.14, Rust 1.14 -> ours
#                   migration; 2.2-2.8 min, plus ~35 s for the first fetch)
#   make integration-sandbox  the integration suite against bin/govirtiofsd
#                   with the default --sandbox namespace --seccomp kill
#   make e2e        the guest boot tests alone (QEMU 7.2 + Linux, TCG)
#   make e2e-full   the longer e2e matrix (run before resolving an issue)
#   make fuzz       every fuzz target for FUZZTIME each (default 60s)
#   make bench      -benchmem microbenchmarks and the side-by-side run against
#                   the reference C virtiofsd and the Rust virtiofsd (test/bench)
#   make bench-scale the scale part of make bench: every file of a 100k-file
#                   share looked up and kept, then 10k opened, on tmpfs, ext4
#                   and overlayfs; fds, memory per inode, lookups/s, errors
#   make bench-guest fio and big-tree walks from a TCG guest against every daemon
#                   (not in make test)
#   make soak       SOAK_DURATION (default 1h) of fio verify + metadata churn in
#                   a TCG guest while the daemon's RSS, fds, threads, goroutines,
#                   inodes and handles are sampled; fails on unbounded growth or
#                   any verify error (not in make test)

export PATH := /usr/local/go/bin:$(PATH)
GO      ?= go
BIN     := bin/govirtiofsd
VERSION ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X main.version=$(VERSION) -linkmode external -extldflags "-static"
FUZZTIME ?= 60s

# Debian packages: build (gcc, libseccomp-dev for static cgo), the
# unprivileged namespace sandbox (uidmap: newuidmap/newgidmap), guest tests
# (QEMU 7.2 with the reference virtiofsd, busybox, cpio, fio, zstd/xz for
# kernel modules).
DEB_PKGS := build-essential libseccomp-dev uidmap qemu-system-x86 qemu-system-common \
	busybox-static cpio fio xz-utils zstd

# Fuzz targets: package:Target.
FUZZ_TARGETS := \
	./internal/virtqueue:FuzzChainWalk \
	./internal/virtqueue:FuzzPackedChainWalk \
	./internal/bufvec:FuzzCursor \
	./internal/vhostuser:FuzzMessages \
	./internal/vhostuser:FuzzWindowReplies \
	./internal/fuse:FuzzServe \
	./internal/fuse:FuzzSecCtx \
	./internal/fuse:FuzzLoadSessionRecord \
	./internal/fuse:FuzzSetupMapping \
	./internal/fuse:FuzzRemoveMapping \
	./internal/passthrough:FuzzLoadState

.PHONY: all build deps test-deps test unit integration-sandbox e2e e2e-full fuzz fuzz-short bench bench-scale bench-guest soak clean

all: deps build

build:
	CGO_ENABLED=1 $(GO) build -trimpath -tags netgo,osusergo -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/govirtiofsd

deps:
	@missing=""; for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# test-deps: QEMU 10 and 11 and the Rust virtiofsd 1.13 and 1.14 for the tests
# (test/peers.sh).
test-deps: deps
	test/peers.sh

test: deps test-deps build
	$(GO) vet ./...
	$(MAKE) unit
	$(MAKE) integration-sandbox
	$(MAKE) fuzz-short
	$(MAKE) e2e

unit:
	$(GO) test -race -count=1 -timeout 15m ./...

# The integration tests run again on packed virtqueues (every device the
# harness connects requires VIRTIO_F_RING_PACKED): those of the data path,
# ring stop/restart (the 1,000-cycle exactness test), guest reset, the
# FS_IO bounce, metrics, dirty logging and migration.
PACKED_RING_TESTS := ^(TestRoundTrips|TestMultiQueue|TestMaxRingIndex|TestStraddlingBuffers|TestStopRestart|TestGuestReset|TestBounce|TestMetrics|TestDirtyLog|TestMigrationRoundTrip|TestMalformedMixedWithValid)

# integration-sandbox: the integration suite against the static daemon in
# the default sandbox (namespace, seccomp kill: a system call outside the
# allowlist fails the test that made it), the sandbox tests (host-side
# checks, seccomp kill and log, an unprivileged user), then the escape,
# CVE and migration tests again in the chroot sandbox (make unit runs them
# with --sandbox none): a migrated inode's path comes from /proc/self/fd,
# which each mode sees differently; then the same and the data path on an
# overlayfs share with an fd budget of 16, so that nearly every request
# evicts or reopens an inode; then PACKED_RING_TESTS on packed rings.
BUDGET_TESTS := ^(TestEscape|TestCVE|TestForgetAbuse|TestStaleIDs|TestMigration|TestFDBudget|TestRoundTrips)
integration-sandbox: deps build
	GOVIRTIOFSD_INTEGRATION_BIN=$(CURDIR)/$(BIN) $(GO) test -count=1 -timeout 20m ./test/integration/
	GOVIRTIOFSD_INTEGRATION_BIN=$(CURDIR)/$(BIN) GOVIRTIOFSD_INTEGRATION_SANDBOX=chroot \
		$(GO) test -count=1 -timeout 10m -run '^(TestEscape|TestCVE|TestForgetAbuse|TestStaleIDs|TestMigration)' ./test/integration/
	GOVIRTIOFSD_INTEGRATION_BIN=$(CURDIR)/$(BIN) GOVIRTIOFSD_INTEGRATION_SHARE=overlay-budget \
		$(GO) test -count=1 -timeout 10m -run '$(BUDGET_TESTS)' ./test/integration/
	GOVIRTIOFSD_INTEGRATION_BIN=$(CURDIR)/$(BIN) GOVIRTIOFSD_INTEGRATION_RINGS=packed \
		$(GO) test -count=1 -timeout 10m -run '$(PACKED_RING_TESTS)' ./test/integration/

e2e: deps test-deps build
	GOVIRTIOFSD_E2E=1 GOVIRTIOFSD_BIN=$(CURDIR)/$(BIN) $(GO) test -count=1 -v -timeout 20m ./test/e2e/

e2e-full: deps test-deps build
	GOVIRTIOFSD_E2E=1 GOVIRTIOFSD_E2E_FULL=1 GOVIRTIOFSD_E2E_REFERENCE=1 GOVIRTIOFSD_BIN=$(CURDIR)/$(BIN) \
		$(GO) test -count=1 -v -timeout 60m ./test/e2e/

fuzz:
	FUZZTIME=$(FUZZTIME) GO=$(GO) test/fuzz.sh $(FUZZ_TARGETS)

fuzz-short:
	$(MAKE) fuzz FUZZTIME=10s

# bench: the -benchmem microbenchmarks, then the side-by-side run of
# govirtiofsd, the reference C virtiofsd (--thread-pool-size 0, 1, 2) and
# the Rust virtiofsd from make test-deps (--thread-pool-size 0 and 2, its
# default sandbox) through the in-repo front end (test/bench; needs root
# for the tmpfs share and the other daemons' namespace sandboxes; about 7
# minutes). BENCHFLAGS are passed to it, e.g.
# BENCHFLAGS='-rounds 1 -duration 1s' or '-configs ours,ref-pool0,rust-pool0'.
# An A/B run against an older build: BENCHFLAGS='-configs ours,ours-2q
# -alt OLD -builds old2=OLD_COPY -rounds 11' (a table of ours/alt paired by
# round; old2/alt, the same build twice, is the spread to beat).
REF_VIRTIOFSD ?= /usr/lib/qemu/virtiofsd
RUST_VIRTIOFSD ?= $(CURDIR)/.cache/peers/bin/virtiofsd-rust
RUST14_VIRTIOFSD ?= $(CURDIR)/.cache/peers/bin/virtiofsd-rust-1.14
BENCHFLAGS ?=
bench: test-deps build
	$(GO) test -run='^$$' -bench=. -benchmem ./...
	$(GO) run ./test/bench/cmd -ours $(CURDIR)/$(BIN) -ref $(REF_VIRTIOFSD) -rust $(RUST_VIRTIOFSD) $(BENCHFLAGS)
	$(MAKE) bench-scale

# bench-scale: the scale run (test/bench RunScale; root): for each file
# system (tmpfs, ext4 on a loop image, overlayfs without nfs_export) a share
# of SCALE_FILES empty files, 1,000 per directory; each daemon with its
# defaults (ours, ours with --inode-file-handles=never, ours with an fd
# budget of 1,024, the C daemon, the Rust daemon 1.13 and 1.14) LOOKUPs every directory and file, keeping each lookup,
# then OPENs 10,000 files. Per daemon: the fds its processes hold, RssAnon
# (plus its own memfd/shm) per inode, the host's slab growth per inode,
# LOOKUPs per second and the errors by errno (EMFILE, ENFILE, ESTALE: a
# figure, not a failure). SCALEFLAGS e.g. '-scale-fs tmpfs -rounds 1
# -scale-depth 8 -scale-configs ours,rust-1.14'. About 3 minutes
# with the defaults; SCALE_FILES=15000,40000,100000,1000000 for the issue's sizes.
SCALE_FILES ?= 100000
SCALE_ROUNDS ?= 3
SCALEFLAGS ?=
bench-scale: test-deps build
	$(GO) run ./test/bench/cmd -scale -scale-files $(SCALE_FILES) -rounds $(SCALE_ROUNDS) -ours $(CURDIR)/$(BIN) \
		-ref $(REF_VIRTIOFSD) -rust $(RUST_VIRTIOFSD) -rust14 $(RUST14_VIRTIOFSD) $(SCALEFLAGS)

# bench-guest: fio from a Linux 6.12 guest under TCG and QEMU 10 (test/e2e
# TestBenchGuest; root) against govirtiofsd (default settings, 1 and 2
# request queues), the reference C virtiofsd and the Rust virtiofsd
# (--thread-pool-size 0 and 2 each), and, on a Linux 7.x guest under QEMU 11
# (the stack of late 2026), ours and the Rust virtiofsd 1.14 (ours-q11,
# rust114-q11, with a q11 ours/rust ratio), one tmpfs share each: 1 MiB write/read libaio at iodepth 16 and 64 with
# numjobs 1 and 4, 4 KiB randwrite/randread at iodepth 16 and 1; prints MiB/s or IOPS and the
# ratios ours/reference and ours/Rust, best of BENCHGUEST_ROUNDS rounds,
# marking figures taken while other processes loaded the host. Roughly 25
# minutes with the defaults (17 with the four configurations before the
# Rust daemon's; not re-timed); narrow it with e.g. BENCHGUEST_RUNTIME=3 BENCHGUEST_ROUNDS=1
# BENCHGUEST_CONFIGS=ours,ref-pool0 BENCHGUEST_WORKLOADS='^seq'; ours-pool0
# and ours-pool1 (--thread-pool-size 0 and 1, Kata's), and ours-packed and
# ours-2q-packed (packed virtqueues: packed=on; with ours and ours-2q the
# table gets packed/split ratios) run only when named.
# BENCHGUEST_ALT=path/to/another/govirtiofsd adds configurations alt and
# alt-2q (A/B comparisons in one run). The walk-* rows (find, ls -lR and
# two lstat passes over BENCHGUEST_WALK_FILES empty files, default 100,000,
# on tmpfs and on an overlayfs without nfs_export, with each daemon's most
# fds) run on ours, the C and both Rust daemons (1.13, 1.14) with their
# defaults and cache auto: BENCHGUEST_WORKLOADS='^walk' runs just them.
# The DAX rows (TestBenchGuestDAX; BENCHGUEST_WORKLOADS=dax runs only them,
# BENCHGUEST_DAX_CONFIGS=ours-dax,ours-auto,rust114-auto,ref-auto a subset):
# a Linux 7.x guest under QEMU 11, ours with a 64 MiB window (dax=always)
# against ours, Rust 1.14 and C at cache auto without DAX, BENCHGUEST_ROUNDS
# rounds: medians [min-max] and the ratio of ours-dax to the best other per round.
# Under TCG the guest is the bottleneck: figures, not targets.
BENCHGUEST_RUNTIME ?= 5
BENCHGUEST_ROUNDS ?= 2
BENCHGUEST_SIZE ?= 64M
BENCHGUEST_CONFIGS ?=
BENCHGUEST_WORKLOADS ?=
BENCHGUEST_ALT ?=
BENCHGUEST_DAX_CONFIGS ?=
BENCHGUEST_WALK_FILES ?= 100000
bench-guest: deps test-deps build
	GOVIRTIOFSD_E2E_BENCH=1 GOVIRTIOFSD_BIN=$(CURDIR)/$(BIN) \
	GOVIRTIOFSD_BENCH_RUNTIME=$(BENCHGUEST_RUNTIME) GOVIRTIOFSD_BENCH_ROUNDS=$(BENCHGUEST_ROUNDS) \
	GOVIRTIOFSD_BENCH_SIZE=$(BENCHGUEST_SIZE) GOVIRTIOFSD_BENCH_WALK_FILES=$(BENCHGUEST_WALK_FILES) \
	GOVIRTIOFSD_BENCH_CONFIGS='$(BENCHGUEST_CONFIGS)' GOVIRTIOFSD_BENCH_WORKLOADS='$(BENCHGUEST_WORKLOADS)' \
	GOVIRTIOFSD_BENCH_ALT='$(if $(BENCHGUEST_ALT),$(abspath $(BENCHGUEST_ALT)))' \
	GOVIRTIOFSD_BENCH_DAX_CONFIGS='$(BENCHGUEST_DAX_CONFIGS)' \
		$(GO) test -count=1 -v -run '^TestBenchGuest(DAX)?$$' -timeout 120m ./test/e2e/

# soak: test/e2e TestSoak (root): a Linux 6.12 guest under TCG runs fio
# write + verify passes and metadata churn (2,000 files created, renamed,
# linked, read back and removed per round) for SOAK_DURATION against the
# daemon as in production, while the host samples the daemon's processes
# and metrics every SOAK_INTERVAL and once per iteration with the guest
# idle. Fails if a verify or churn check fails, the daemon dies or stalls,
# or RSS, fds, threads, goroutines, open inodes or handles keep growing over
# the second half (least-squares slope; test/e2e/README.md). The samples
# (CSV) and the summary table land in the test's log directory. The go test
# timeout is SOAK_DURATION + 30m: a duration's terms add up, so 16m30m is 46m.
SOAK_DURATION ?= 1h
SOAK_INTERVAL ?= 10s
soak: deps test-deps build
	GOVIRTIOFSD_SOAK=$(SOAK_DURATION) GOVIRTIOFSD_SOAK_INTERVAL=$(SOAK_INTERVAL) GOVIRTIOFSD_BIN=$(CURDIR)/$(BIN) \
		$(GO) test -count=1 -v -run '^TestSoak$$' -timeout $(SOAK_DURATION)30m ./test/e2e/

clean:
	rm -rf bin .cache
