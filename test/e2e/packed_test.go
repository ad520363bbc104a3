//go:build linux

package e2e

// Packed virtqueues (virtio 1.1+, VIRTIO_F_RING_PACKED, DESIGN.md §11):
// QEMU 10's vhost-user-fs-pci takes packed=on and uses packed rings only if
// the back end offers bit 34; otherwise it silently gives the guest split
// rings. Every test here therefore checks, from the guest's own report
// (guest-init.sh's E2E-VIRTIO lines: /sys/bus/virtio/devices/*/features),
// that the virtio-fs device negotiated bit 34.

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

const (
	// virtioIDFS is the virtio device id of virtio-fs (26), as
	// /sys/bus/virtio/devices/*/device shows it.
	virtioIDFS = "0x001a"
	// virtioFRingPacked is VIRTIO_F_RING_PACKED.
	virtioFRingPacked = 34
)

// packedVM is the base vmConfig of a packed-ring scenario: QEMU 10 with
// packed=on on the vhost-user-fs-pci device.
var packedVM = vmConfig{QEMU: qemu10, Packed: true}

// reVirtio is guest-init.sh's report of one virtio device: its sysfs name,
// device id and negotiated features ('0'/'1' per bit, bit 0 first).
var reVirtio = regexp.MustCompile(`E2E-VIRTIO dev=(\S+) device=(\S+) features=([01]+)`)

// virtioDevice is one E2E-VIRTIO line.
type virtioDevice struct {
	Boot     int // 1-based
	Name     string
	Device   string
	Features string
}

// bit reports whether feature bit n was negotiated.
func (d virtioDevice) bit(n int) bool { return n < len(d.Features) && d.Features[n] == '1' }

// parseVirtio returns the E2E-VIRTIO lines of a console, numbered by boot.
func parseVirtio(lines []string) []virtioDevice {
	var out []virtioDevice
	boot := 0
	for _, l := range lines {
		if reBoot.MatchString(l) {
			boot++
		}
		if m := reVirtio.FindStringSubmatch(l); m != nil {
			out = append(out, virtioDevice{Boot: boot, Name: m[1], Device: m[2], Features: m[3]})
		}
	}
	return out
}

// fsDevices returns the virtio-fs devices of boot (1-based).
func fsDevices(devs []virtioDevice, boot int) []virtioDevice {
	var out []virtioDevice
	for _, d := range devs {
		if d.Boot == boot && d.Device == virtioIDFS {
			out = append(out, d)
		}
	}
	return out
}

// packedProblem says why the guest's console does not show `boots` boots
// each with exactly one virtio-fs device that negotiated packed rings, or
// returns "".
func packedProblem(lines []string, boots int) string {
	devs := parseVirtio(lines)
	for b := 1; b <= boots; b++ {
		fs := fsDevices(devs, b)
		switch {
		case len(fs) == 0:
			return fmt.Sprintf("boot %d: the guest reported no virtio-fs device (no E2E-VIRTIO line with device=%s; an initramfs built before guest-init.sh reported features?)",
				b, virtioIDFS)
		case len(fs) > 1:
			return fmt.Sprintf("boot %d: the guest reported %d virtio-fs devices, want 1", b, len(fs))
		case !fs[0].bit(virtioFRingPacked):
			return fmt.Sprintf("boot %d: asked for packed=on but the guest negotiated a SPLIT ring: bit %d (VIRTIO_F_RING_PACKED) is clear in %s's features %s "+
				"(QEMU falls back to split rings silently when the back end does not offer bit %d)",
				b, virtioFRingPacked, fs[0].Name, fs[0].Features, virtioFRingPacked)
		}
	}
	return ""
}

// requirePacked fails the test unless each of the first `boots` boots on
// the console negotiated packed rings for the virtio-fs device (bit 34 set
// in the guest's /sys/bus/virtio/devices/*/features).
func requirePacked(t *testing.T, lines []string, boots int) {
	t.Helper()
	if p := packedProblem(lines, boots); p != "" {
		t.Fatalf("packed virtqueues: %s", p)
	}
	t.Logf("guest: virtio-fs negotiated packed virtqueues (bit %d set) on %d boot(s)", virtioFRingPacked, boots)
}

// ringLayout describes the virtio-fs ring layout of each boot on the
// console, for logs: "packed rings", "split, then split rings", ...
func ringLayout(lines []string) string {
	devs := parseVirtio(lines)
	var parts []string
	for b := 1; ; b++ {
		fs := fsDevices(devs, b)
		if len(fs) == 0 {
			break
		}
		parts = append(parts, ringName(fs[0].bit(virtioFRingPacked)))
	}
	if len(parts) == 0 {
		return "ring layout not reported"
	}
	return strings.Join(parts, ", then ") + " rings"
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

func ringName(packed bool) string {
	if packed {
		return "packed"
	}
	return "split"
}

// qemuVirtioFS is what QEMU says of its vhost-user-fs device
// (x-query-virtio-status): the transport features the guest acked, and
// those the vhost device acked to the back end.
type qemuVirtioFS struct {
	Path            string
	GuestTransports []string
	VhostAcked      []string
	Raw             string
}

// virtioFS asks QEMU (QMP x-query-virtio, then x-query-virtio-status) about
// its vhost-user-fs device.
func (v *vm) virtioFS() (qemuVirtioFS, error) {
	v.t.Helper()
	raw, err := v.qmpTry("x-query-virtio", nil)
	if err != nil {
		return qemuVirtioFS{}, err
	}
	var devs []struct {
		Path string `json:"path"`
		Name string `json:"name"`
	}
	if err := json.Unmarshal(raw, &devs); err != nil {
		return qemuVirtioFS{}, fmt.Errorf("x-query-virtio: %v: %s", err, raw)
	}
	i := slices.IndexFunc(devs, func(d struct {
		Path string `json:"path"`
		Name string `json:"name"`
	}) bool {
		return d.Name == "virtio-user-fs" // QEMU 10's name for vhost-user-fs
	})
	if i < 0 {
		return qemuVirtioFS{}, fmt.Errorf("x-query-virtio lists no virtio-user-fs device: %s", raw)
	}
	raw, err = v.qmpTry("x-query-virtio-status", map[string]any{"path": devs[i].Path})
	if err != nil {
		return qemuVirtioFS{}, err
	}
	type features struct {
		Transports []string `json:"transports"`
	}
	var st struct {
		Guest features `json:"guest-features"`
		Vhost *struct {
			Acked features `json:"acked-features"`
		} `json:"vhost-dev"`
	}
	if err := json.Unmarshal(raw, &st); err != nil {
		return qemuVirtioFS{}, fmt.Errorf("x-query-virtio-status: %v: %s", err, raw)
	}
	q := qemuVirtioFS{Path: devs[i].Path, GuestTransports: st.Guest.Transports, Raw: string(raw)}
	if st.Vhost != nil {
		q.VhostAcked = st.Vhost.Acked.Transports
	}
	return q, nil
}

func hasFeature(names []string, name string) bool {
	return slices.ContainsFunc(names, func(s string) bool { return strings.HasPrefix(s, name+":") || s == name })
}

// requireQEMUPacked fails the test unless QEMU runs its vhost-user-fs
// device on packed rings: VIRTIO_F_RING_PACKED among the features the guest
// acked and among those the vhost device acked to the back end. After a
// migration the guest does not negotiate again: this is how the
// destination is checked.
func requireQEMUPacked(t *testing.T, v *vm) {
	t.Helper()
	q, err := v.virtioFS()
	if err != nil {
		t.Fatalf("%s: %v", v.label(), err)
	}
	const name = "VIRTIO_F_RING_PACKED"
	if !hasFeature(q.GuestTransports, name) || !hasFeature(q.VhostAcked, name) {
		t.Fatalf("%s: %s not in the features of %s: guest %v, acked to the back end %v", v.label(), name, q.Path, q.GuestTransports, q.VhostAcked)
	}
	t.Logf("%s: %s runs on packed rings (%s acked by the guest and to the back end)", v.label(), q.Path, name)
}

// Packed-ring phases of runMultiqueueFio (guest-scripts/mq-fio.sh: 1 MiB
// sequential and 4 KiB random, write + crc32c read-verify, libaio iodepth
// 4, O_DIRECT).
var (
	// packedBoot is make test's packed-ring boot: 4 jobs (many requests
	// in flight, completed out of order) on one request queue, small
	// files, --log-level debug so the ring accounting is checked.
	packedBoot = mqPhase{name: "boot", logLevel: "debug", seqSize: 8 << 20, randSize: 2 << 20, countRing: true,
		queues: 1, jobs: 4, packed: true}
	// packedFull: e2e-full's fio on packed rings (1 and 4 jobs, info
	// level as in production) and 2 request queues (debug: requests must
	// be spread over both rings and each ring's accounting match).
	packedFull = []mqPhase{
		{name: "fio-j1", logLevel: "info", seqSize: 32 << 20, randSize: 8 << 20, queues: 1, jobs: 1, packed: true},
		{name: "fio-j4", logLevel: "info", seqSize: 16 << 20, randSize: 2 << 20, queues: 1, jobs: 4, packed: true},
		{name: "2queues", logLevel: "debug", seqSize: 4 << 20, randSize: 1 << 20, countRing: true, queues: 2, jobs: 4, packed: true},
	}
)

// TestPackedRing runs guests on packed virtqueues: QEMU 10 with packed=on
// on vhost-user-fs-pci and Linux 6.12 against our daemon. Each scenario
// first requires the guest to have negotiated VIRTIO_F_RING_PACKED (bit
// 34): QEMU falls back to split rings silently when the back end does not
// offer it, which would make the rest prove nothing.
//
// make e2e (and so make test) runs one boot: fio numjobs=4 on one request
// queue, 1 MiB sequential and 4 KiB random write + crc32c verify, the
// daemon at --log-level debug, the ring accounting checked (checkRings).
// GOVIRTIOFSD_E2E_FULL=1 adds the matrix, each reusing the split-ring
// scenario with packed rings:
//   - fio-j1, fio-j4: runMultiqueueFio with 1 and 4 jobs (info level);
//   - 2queues: num-request-queues=2, requests on both rings;
//   - reboot: scenarioReboot (the rings start again at their reset state);
//   - posix: posixSideBySide, ours on packed rings against the reference C
//     daemon under the same QEMU 10 command line (it does not offer bit
//     34: QEMU gives it split rings, logged);
//   - migrate: TestMigration's basic scenario ours→ours, packed=on on both
//     sides; the destination QEMU must run the device on packed rings
//     (requireQEMUPacked);
//   - migrate-to-rust, migrate-to-c: ours (packed) → the Rust virtiofsd
//     1.13, and → the reference C daemon; neither offers bit 34: the
//     migration must fail, the source resume on its packed rings and the
//     guest go on there.
func TestPackedRing(t *testing.T) {
	requireE2E(t)
	peersBin(t, qemu10Wrapper)
	k := newestKernelAtLeast(t, 6, 12, "packed rings are tested under QEMU 10, which runs Linux 6.12 guests only")
	start := time.Now()
	packedMatrix(t, qemu10, k, rustDaemon)
	if fullE2E() {
		// The same on the late-2026 stack (DESIGN.md §12): Linux 7.x under
		// QEMU 11, ours → the Rust virtiofsd 1.14 for migrate-to-rust.
		t.Run("qemu11", func(t *testing.T) {
			peersBin(t, qemu11Wrapper)
			packedMatrix(t, qemu11, newestKernel7(t), rust114Daemon)
		})
	}
	t.Logf("TestPackedRing took %.1fs", time.Since(start).Seconds())
}

// packedMatrix is TestPackedRing's scenarios on QEMU q with kernel k; rust
// is the Rust daemon of migrate-to-rust.
func packedMatrix(t *testing.T, q qemuVersion, k guestKernel, rust daemonKind) {
	timed := func(name string, fn func(t *testing.T)) {
		t.Run(name, func(t *testing.T) {
			st := time.Now()
			defer func() { t.Logf("%s took %.1fs", name, time.Since(st).Seconds()) }()
			fn(t)
		})
	}
	base := packedVM
	base.QEMU = q
	onQEMU := func(m *migEnv) *migEnv {
		m.cfg.QEMU = q
		return m
	}
	boot := packedBoot
	boot.qemu = q
	timed(boot.name, func(t *testing.T) { runMultiqueueFio(t, k, boot) })
	if fullE2E() {
		for _, ph := range packedFull {
			ph.qemu = q
			timed(ph.name, func(t *testing.T) { runMultiqueueFio(t, k, ph) })
		}
		timed("reboot", func(t *testing.T) { scenarioReboot(t, ourDaemon, k, base) })
		timed("posix", func(t *testing.T) {
			requireReference(t)
			posixSideBySide(t, k, base, posixShare{})
		})
		timed("migrate", func(t *testing.T) {
			scenarioMigratePacked(onQEMU(newMigEnv(t, migPair{"ours-ours", ourDaemon, ourDaemon}, k)))
		})
		timed("migrate-to-rust", func(t *testing.T) {
			scenarioMigratePackedToSplit(onQEMU(newMigEnv(t, migPair{"ours-rust", ourDaemon, rust}, k)))
		})
		timed("migrate-to-c", func(t *testing.T) {
			requireReference(t)
			scenarioMigratePackedToSplit(onQEMU(newMigEnv(t, migPair{"ours-c", ourDaemon, refDaemon}, k)))
		})
	}
}

// scenarioMigratePacked: the basic migration scenario (fio verify and the
// appender while the guest migrates) with packed=on on both QEMUs; the
// source's guest must have negotiated packed rings (checked before
// migrating, migrateOnce) and the destination QEMU must run the device on
// them.
func scenarioMigratePacked(m *migEnv) {
	m.cfg.Packed = true
	scenarioMigrateBasic(m)
	// The rings go on where they stopped: each ring the destination
	// daemon started first at the base (both indices and wrap counters)
	// the source's daemon stopped it at.
	t := m.t
	src, dst := m.hops[0], m.hops[1]
	stopped, started := ringStopBases(t, src.d), ringStartBases(t, dst.d)
	for q := 0; q <= 1; q++ {
		b, ok := stopped[q]
		switch {
		case !ok:
			t.Errorf("queue=%d: the source daemon did not log one \"ring stopped\"", q)
		case started[q] != b:
			t.Errorf("queue=%d: the source stopped the ring at base %#x, the destination started it at %#x", q, b, started[q])
		default:
			t.Logf("queue=%d: stopped on the source and started on the destination at base %#x (avail and used index %d, wrap %d)",
				q, b, b&0x7fff, b>>15&1)
		}
	}
}

// ringStartBases returns, per ring, the base of the first "ring started"
// line in a daemon's log (debug level).
func ringStartBases(t *testing.T, d *daemon) map[int]int {
	t.Helper()
	out := map[int]int{}
	for _, l := range strings.Split(readFile(t, d.LogPath), "\n") {
		kv := parseLogfmt(l)
		if kv["msg"] != "ring started" {
			continue
		}
		q, err1 := strconv.Atoi(kv["queue"])
		b, err2 := strconv.ParseInt(kv["base"], 0, 64)
		if _, seen := out[q]; err1 == nil && err2 == nil && !seen {
			out[q] = int(b)
		}
	}
	return out
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

// scenarioMigratePackedToSplit: a guest on packed rings (ours) migrates to
// a daemon that does not offer them (the pair's destination, e.g. the Rust
// virtiofsd 1.13). The destination QEMU cannot give the guest the packed
// rings it runs on, so the migration must fail; the source must resume
// (its daemon restarting the packed rings where they stopped) and the
// guest go on there with every fd working and every fio pass verified.
func scenarioMigratePackedToSplit(m *migEnv) {
	t := m.t
	m.cfg.Packed = true
	m.startHop()
	m.waitAsk(1)
	requirePacked(t, m.con.lines(), 1)
	src := m.cur
	dst := m.startHop()
	info := m.migrateTo(dst, migrateOptions{})
	m.requireStatus(info, "failed")
	m.requireRunning(src)
	m.failedDestination(dst)
	// Why: QEMU 10's destination loads the guest's features and refuses
	// those its back end does not offer ("Features 0x530000000
	// unsupported. Allowed features: 0x178000000": bit 34).
	if why := grepLines(dst.v.consoleLines(), "unsupported. Allowed features"); len(why) == 0 {
		t.Errorf("%s: QEMU did not say the guest's features are unsupported; its last lines:\n%s", dst.name, lastLines(dst.v.consoleLines(), 10))
	} else {
		t.Logf("%s: %s", dst.name, why[0])
	}
	m.con.answer("failed")
	m.finish()
	m.logVhostUser()
	r := m.judgeGuest(1)
	m.checkShare(r, "read.txt", "append.txt")
}

// TestParseVirtio checks the E2E-VIRTIO parser and the packed-ring verdict
// (no root).
func TestParseVirtio(t *testing.T) {
	split := strings.Repeat("0", 32) + "1" + strings.Repeat("0", 31)    // bit 32 (VERSION_1) only
	packed := strings.Repeat("0", 32) + "101" + strings.Repeat("0", 29) // bits 32 and 34
	lines := []string{
		"E2E-BOOT kernel=6.12.117+deb12-cloud-amd64 uptime=2.1",
		"E2E-VIRTIO dev=virtio0 device=0x001a features=" + packed,
		"E2E-STEP-BEGIN mount", "E2E-STEP mount rc=0",
		"E2E-DONE action=reboot uptime=9.0",
		"E2E-BOOT kernel=6.12.117+deb12-cloud-amd64 uptime=2.0",
		"E2E-VIRTIO dev=virtio1 device=0x0001 features=" + packed, // not virtio-fs
		"E2E-VIRTIO dev=virtio0 device=0x001a features=" + split,
	}
	devs := parseVirtio(lines)
	if len(devs) != 3 || devs[0].Boot != 1 || devs[2].Boot != 2 || devs[2].Name != "virtio0" || !devs[0].bit(34) || devs[2].bit(34) || !devs[2].bit(32) {
		t.Fatalf("parseVirtio: %+v", devs)
	}
	if p := packedProblem(lines, 1); p != "" {
		t.Errorf("boot 1 is packed, got %q", p)
	}
	if p := packedProblem(lines, 2); !strings.Contains(p, "boot 2") || !strings.Contains(p, "SPLIT") {
		t.Errorf("boot 2 is split, got %q", p)
	}
	if p := packedProblem(lines[:1], 1); !strings.Contains(p, "no virtio-fs device") {
		t.Errorf("no report, got %q", p)
	}
	if got := ringLayout(lines); got != "packed, then split rings" {
		t.Errorf("ringLayout: %q", got)
	}
}

// TestRingStopPacked checks the packed GET_VRING_BASE check of checkRings
// (no root).
func TestRingStopPacked(t *testing.T) {
	for _, c := range []struct {
		base, n int
		ok      bool
	}{
		{0x80008000, 0, true}, // reset state: both indices 0, both wraps 1
		{0x80058005, 5, true},
		{0x83ff83ff, 1023, true},
		{0, 1024, true}, // wrapped once: index 0, wrap 0
		{0x00030003, 1027, true},
		{0x80038003, 2051, true}, // wrapped twice
		{0x00030003, 3, false},   // wrap counters wrong
		{0x80048004, 3, false},
		{0x80048005, 5, false}, // a chain popped but not completed
		{0x00058005, 5, false}, // used wrap counter wrong
	} {
		if got := ringStopPacked(c.base, c.n, 1024) == ""; got != c.ok {
			t.Errorf("ringStopPacked(%#x, %d) ok=%v, want %v", c.base, c.n, got, c.ok)
		}
	}
}

// TestHasFeature: QEMU's feature names carry a description after a colon.
func TestHasFeature(t *testing.T) {
	if !hasFeature([]string{"VIRTIO_F_RING_PACKED: Device supports packed VQ layout"}, "VIRTIO_F_RING_PACKED") ||
		hasFeature([]string{"VIRTIO_F_RING_PACKED_X: x"}, "VIRTIO_F_RING_PACKED") {
		t.Error("hasFeature")
	}
}
