//go:build linux

package e2e

import (
	"fmt"
	"os"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The multiqueue fio runs (guest-scripts/mq-fio.sh): the request queues
// QEMU gives the device, fio numjobs and per-job file sizes per phase.
const (
	mqQueues = 2
	mqJobs   = 4
)

type mqPhase struct {
	name      string
	logLevel  string
	seqSize   int64 // per job, 1 MiB blocks
	randSize  int64 // per job, 4 KiB blocks
	countRing bool  // assert on the per-request debug lines
	queues    int   // num-request-queues (0: mqQueues)
	jobs      int   // fio numjobs (0: mqJobs)
	// packed runs the guest on packed virtqueues (QEMU 10, packed=on;
	// requirePacked): TestPackedRing.
	packed bool
	// qemu is the QEMU of a packed phase (zero: QEMU 10).
	qemu qemuVersion
}

func (ph mqPhase) numQueues() int {
	if ph.queues == 0 {
		return mqQueues
	}
	return ph.queues
}

func (ph mqPhase) numJobs() int {
	if ph.jobs == 0 {
		return mqJobs
	}
	return ph.jobs
}

var mqPhases = []mqPhase{
	{name: "rings", logLevel: "debug", seqSize: 4 << 20, randSize: 1 << 20, countRing: true},
	{name: "fio", logLevel: "info", seqSize: 16 << 20, randSize: 2 << 20},
}

// TestMultiqueueFio boots Linux 6.12 (the first series that spreads requests
// over several request queues: each CPU submits on its own queue) with
// vhost-user-fs-pci num-request-queues=2 against our daemon with its default
// settings (plus --cache never), and runs fio numjobs=4 (libaio iodepth 4,
// O_DIRECT) write + read-verify passes (verify=crc32c, verify_fatal) with
// 1 MiB sequential and 4 KiB random blocks. Every block must verify.
//
// Two boots, each with a fresh daemon and share:
//   - rings: --log-level debug, small files. The per-request debug line is
//     the daemon's only record of the ring that carried a request: READs and
//     WRITEs must have arrived on both request rings (queue=1 and queue=2),
//     nowhere beyond them, and each ring's final avail index (logged when
//     QEMU stops the device) must equal the requests logged on it.
//   - fio: --log-level info as in production (the debug line is a write(2)
//     per request on the queue goroutine, which competes with the TCG vCPUs
//     for the host's cores), larger files; its fio figures are the ones to
//     quote.
//
// Both check the guest's completion interrupts: each request queue's vector
// (virtioN-requests.0, .1) must have fired during fio, i.e. the daemon
// completed requests on both rings.
//
// Ours only: the reference C daemon (QEMU 7.2) dies when the front end
// starts a second request queue, and QEMU 7.2 ignores GET_QUEUE_NUM for fs
// devices, so the queue count comes from num-request-queues alone.
func TestMultiqueueFio(t *testing.T) {
	requireE2E(t)
	var k guestKernel
	for _, gk := range guestKernels(t) {
		if kernelAtLeast(gk.Version, 6, 11) {
			k = gk
		}
	}
	if k.Version == "" {
		t.Skip("no guest kernel >= 6.11 prepared (multiqueue virtio-fs needs Linux 6.11; see GOVIRTIOFSD_E2E_KERNELS)")
	}
	start := time.Now()
	for _, ph := range mqPhases {
		t.Run(ph.name, func(t *testing.T) { runMultiqueueFio(t, k, ph) })
	}
	t.Logf("both boots took %.1fs", time.Since(start).Seconds())
}

// runMultiqueueFio boots the guest on mq-fio.sh with ph's request queues,
// fio jobs and ring layout, and checks every pass, the completion
// interrupts and (countRing) the per-ring request accounting.
func runMultiqueueFio(t *testing.T, k guestKernel, ph mqPhase) {
	start := time.Now()
	queues, jobs := ph.numQueues(), ph.numJobs()
	e := newEnv(t, ourDaemon, k, "--cache", "never", "--log-level", ph.logLevel)
	cfg := vmConfig{
		Script: "mq-fio", Timeout: 3 * time.Minute,
		DeviceOpts: []string{"num-request-queues=" + strconv.Itoa(queues)},
		Append: []string{
			"e2e.mqjobs=" + strconv.Itoa(jobs),
			"e2e.mqseqsize=" + strconv.FormatInt(ph.seqSize>>10, 10) + "k",
			"e2e.mqrandsize=" + strconv.FormatInt(ph.randSize>>10, 10) + "k",
		},
	}
	if ph.packed {
		cfg.QEMU, cfg.Packed = qemu10, true
		if ph.qemu != qemu72 {
			cfg.QEMU = ph.qemu
		}
	}
	v := e.start(cfg)
	v.waitExit()
	e.daemonExit(v, true)
	g := parseConsole(v.consoleLines())
	t.Logf("%s, %s, %d request queue(s), packed=%s, fio numjobs=%d, daemon --log-level %s: QEMU ran %.1fs (E2E-BOOT at %v, mounted at %v)",
		k.Version, cfg.QEMU, queues, onOff(ph.packed), jobs, ph.logLevel, v.ExitTime().Sub(v.started).Seconds(), v.markerTimes(reBoot), v.markerTimes(reMounted))
	if ph.packed {
		requirePacked(t, v.consoleLines(), 1)
	}
	for _, l := range e.d.lifecycleLines(t) {
		t.Logf("  daemon: %s", l)
	}
	defer func() {
		for _, l := range warnLines(t, e.d) {
			t.Logf("  daemon: %s", l)
		}
		t.Logf("%s took %.1fs", ph.name, time.Since(start).Seconds())
	}()

	// Guest side: every pass ran, moved all its bytes and verified.
	if m := g.step(t, 1, "mount"); m.RC != 0 {
		t.Fatalf("mount -t virtiofs failed (rc=%d): %v", m.RC, m.Output)
	}
	res := map[string]fioResult{}
	for _, l := range v.consoleLines() {
		if m := reFio.FindStringSubmatch(l); m != nil {
			r, err := parseFioTerse(m[1], m[2])
			if err != nil {
				t.Error(err)
				continue
			}
			res[m[1]] = r
		}
	}
	steps := v.stepDurations()
	t.Logf("fio from %s, %d request queue(s), %s, numjobs=%d, libaio iodepth 4 per job, O_DIRECT, cache=none, verify=crc32c, daemon --log-level %s (group_reporting):",
		k.Version, queues, ringLayout(v.consoleLines()), jobs, ph.logLevel)
	for _, j := range []struct {
		name string
		size int64
	}{{"mq-seq-1m", ph.seqSize}, {"mq-rand-4k", ph.randSize}} {
		for _, pass := range []string{"write", "read"} {
			name := j.name + "-" + pass
			st := findStep(g, "fio-"+name)
			r, ok := res[name]
			switch {
			case st == nil:
				t.Errorf("fio pass %s did not run", name)
				continue
			case st.RC != 0 || !ok || r.Error != 0:
				t.Errorf("fio pass %s failed: rc=%d error=%d\n%s", name, st.RC, r.Error, lastLines(st.Output, 20))
				continue
			case r.KiB*1024 != j.size*int64(jobs):
				t.Errorf("fio pass %s moved %d KiB, want %d", name, r.KiB, j.size*int64(jobs)>>10)
			}
			t.Logf("  %-17s %7.1f MiB/s %7.0f IOPS  %6d KiB in %5d ms (step %.1fs)",
				name, float64(r.BWKiB)/1024, r.IOPS, r.KiB, r.RuntimeMS, steps["fio-"+name].Seconds())
		}
	}
	if st := findStep(g, "mq-rm"); st == nil || st.RC != 0 {
		t.Errorf("rm -rf /mnt/mq failed: %+v", st)
	}

	// Guest side: completion interrupts on every request queue's vector.
	irqs, irqLines := irqDeltas(v.consoleLines())
	for _, l := range irqLines {
		t.Logf("  guest interrupts during fio: %s", l)
	}
	for q := 0; q < queues; q++ {
		if irqs["requests."+strconv.Itoa(q)] <= 0 {
			t.Errorf("guest: no completion interrupt on request queue %d (requests.%d) during fio: %v", q, q, irqLines)
		}
	}
	if ph.countRing {
		checkRings(t, e.d, queues, ph.packed)
	}
}

// checkRings counts the daemon's per-request debug lines by ring: READs and
// WRITEs must have arrived on every request ring (queue=1..queues), none
// beyond, all succeeded, and each ring's final avail index (GET_VRING_BASE
// when QEMU stops the device) must match the requests logged on it: equal
// on a split ring (below 2^16 requests); on a packed ring (ringStopPacked)
// the index counts descriptor slots modulo the queue size, with the wrap
// counter in bit 15.
func checkRings(t *testing.T, d *daemon, queues int, packed bool) {
	t.Helper()
	counts := map[string]map[string]int{} // queue -> opcode -> requests
	for _, r := range d.fuseRequests(t) {
		if counts[r.Queue] == nil {
			counts[r.Queue] = map[string]int{}
		}
		counts[r.Queue][r.Opcode]++
		if (r.Opcode == "READ" || r.Opcode == "WRITE") && r.Error != 0 {
			t.Errorf("daemon: %s on queue %s failed: error=%d (unique %s)", r.Opcode, r.Queue, r.Error, r.Unique)
		}
	}
	var seen []string
	for q := range counts {
		seen = append(seen, q)
	}
	sort.Strings(seen)
	t.Logf("FUSE requests per ring (daemon log; queue 0 is hiprio, 1..%d the request queues):", queues)
	for _, q := range seen {
		t.Logf("  queue=%s: %d READ, %d WRITE, %d in all (%s)", q, counts[q]["READ"], counts[q]["WRITE"], total(counts[q]), opcodeSummary(counts[q]))
		if n, err := strconv.Atoi(q); err != nil || n < 0 || n > queues {
			t.Errorf("daemon: %d requests on queue=%s, the device has rings 0..%d", total(counts[q]), q, queues)
		}
	}
	for q := 1; q <= queues; q++ {
		c := counts[strconv.Itoa(q)]
		if c["READ"] == 0 || c["WRITE"] == 0 {
			t.Errorf("request queue %d (queue=%d) served %d READ and %d WRITE requests, want both > 0: requests were not spread over the rings",
				q-1, q, c["READ"], c["WRITE"])
		}
	}
	bases := ringStopBases(t, d)
	for q := 0; q <= queues; q++ {
		base, ok := bases[q]
		n := total(counts[strconv.Itoa(q)])
		switch {
		case !ok:
			t.Errorf("queue=%d: no single \"ring stopped\" line in the daemon log", q)
		case packed:
			if msg := ringStopPacked(base, n, ringQueueSize); msg != "" {
				t.Errorf("queue=%d (packed): %s", q, msg)
			} else {
				t.Logf("queue=%d (packed): ring stopped at base %#x: avail and used index %d, wrap %d, after %d requests", q, base, base&0x7fff, base>>15&1, n)
			}
		case n < 1<<16 && n != base:
			t.Errorf("queue=%d: ring stopped at avail index %d but the daemon logged %d requests on it", q, base, n)
		}
	}
}

// ringQueueSize is the queue size startVM gives the device (queue-size=1024).
const ringQueueSize = 1024

// ringStopPacked checks a packed ring's base as GET_VRING_BASE reports it
// (DESIGN.md §11: bits 0-14 the next avail index, bit 15 the driver's wrap
// counter, which starts at 1; bits 16-30 the used index, bit 31 the used
// wrap counter) after n requests. Linux puts every request of more than one
// buffer in an indirect table (one slot; the device offers
// INDIRECT_DESC), and a FORGET on the hiprio ring is one buffer: every
// request took one slot. The ring stops only once every chain it popped
// is completed, so the used side must equal the avail side. It returns
// what is wrong, or "".
func ringStopPacked(base, n, size int) string {
	avail, wrap := base&0x7fff, base>>15&1
	used, usedWrap := base>>16&0x7fff, base>>31&1
	wantAvail, wantWrap := n%size, 1^(n/size)&1
	switch {
	case avail != wantAvail || wrap != wantWrap:
		return fmt.Sprintf("ring stopped at base %#x (avail index %d, wrap %d) but the daemon logged %d requests on it: want avail index %d, wrap %d (one slot a request, queue size %d)",
			base, avail, wrap, n, wantAvail, wantWrap, size)
	case used != avail || usedWrap != wrap:
		return fmt.Sprintf("ring stopped at base %#x with used index %d, wrap %d behind avail index %d, wrap %d: a popped chain was not completed",
			base, used, usedWrap, avail, wrap)
	}
	return ""
}

// kernelAtLeast reports whether a `uname -r` string is at least major.minor.
func kernelAtLeast(version string, major, minor int) bool {
	f := strings.SplitN(version, ".", 3)
	if len(f) < 2 {
		return false
	}
	ma, err1 := strconv.Atoi(f[0])
	mi, err2 := strconv.Atoi(strings.TrimLeftFunc(f[1], func(r rune) bool { return r < '0' || r > '9' }))
	if err1 != nil || err2 != nil {
		return false
	}
	return ma > major || ma == major && mi >= minor
}

func findStep(g guestRun, name string) *guestStep {
	for i := range g.Steps {
		if g.Steps[i].Name == name {
			return &g.Steps[i]
		}
	}
	return nil
}

func total(m map[string]int) int {
	n := 0
	for _, c := range m {
		n += c
	}
	return n
}

func opcodeSummary(m map[string]int) string {
	var ops []string
	for op := range m {
		ops = append(ops, op)
	}
	sort.Strings(ops)
	for i, op := range ops {
		ops[i] = op + "=" + strconv.Itoa(m[op])
	}
	return strings.Join(ops, " ")
}

// reIRQ matches one /proc/interrupts line as mq-fio.sh prints it:
// "E2E-IRQ before|after  NN:  <count per CPU> ... <chip> <hwirq> <name>".
var reIRQ = regexp.MustCompile(`^E2E-IRQ (\S+)\s+(\S+):((?:\s+\d+)+)\s+(.*)$`)

// irqDeltas returns the interrupts of each virtio vector between mq-fio.sh's
// "before" and "after" snapshots, keyed by the name without its "virtioN-"
// prefix (hiprio, requests.0, ...), and one line per vector for the log.
func irqDeltas(lines []string) (map[string]int64, []string) {
	snaps := map[string]map[string][]int64{} // when -> name -> per CPU
	var names []string
	for _, l := range lines {
		m := reIRQ.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		name := m[2]
		if f := strings.Fields(m[4]); len(f) > 0 {
			name = f[len(f)-1]
		}
		var per []int64
		for _, c := range strings.Fields(m[3]) {
			n, _ := strconv.ParseInt(c, 10, 64)
			per = append(per, n)
		}
		if snaps[m[1]] == nil {
			snaps[m[1]] = map[string][]int64{}
		}
		if m[1] == "after" {
			names = append(names, name)
		}
		snaps[m[1]][name] = per
	}
	deltas := map[string]int64{}
	var out []string
	for _, n := range names {
		a, b := snaps["after"][n], snaps["before"][n]
		var sum int64
		per := make([]string, len(a))
		for i, c := range a {
			if i < len(b) {
				c -= b[i]
			}
			sum += c
			per[i] = strconv.FormatInt(c, 10)
		}
		key := n
		if i := strings.IndexByte(n, '-'); strings.HasPrefix(n, "virtio") && i >= 0 {
			key = n[i+1:]
		}
		deltas[key] = sum
		out = append(out, fmt.Sprintf("%s: %d (per CPU %s)", n, sum, strings.Join(per, "+")))
	}
	return deltas, out
}

// warnLines returns the daemon's WARN and ERROR lines.
func warnLines(t *testing.T, d *daemon) []string {
	t.Helper()
	data, err := os.ReadFile(d.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range strings.Split(string(data), "\n") {
		if lv := parseLogfmt(l)["level"]; lv == "WARN" || lv == "ERROR" {
			out = append(out, l)
		}
	}
	return out
}

// ringStopBases returns, per ring the daemon stopped exactly once, the base
// it logged ("ring stopped" at debug level).
func ringStopBases(t *testing.T, d *daemon) map[int]int {
	t.Helper()
	data, err := os.ReadFile(d.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	bases, stops := map[int]int{}, map[int]int{}
	for _, l := range strings.Split(string(data), "\n") {
		kv := parseLogfmt(l)
		if kv["msg"] != "ring stopped" {
			continue
		}
		q, err1 := strconv.Atoi(kv["queue"])
		b, err2 := strconv.ParseInt(kv["base"], 0, 64) // decimal, or 0x... hex
		if err1 != nil || err2 != nil {
			continue
		}
		bases[q] = int(b)
		stops[q]++
	}
	for q, n := range stops {
		if n != 1 {
			delete(bases, q)
		}
	}
	return bases
}

func TestParseIRQ(t *testing.T) {
	lines := []string{
		"E2E-IRQ before  24:          0          0  PCI-MSIX-0000:00:02.0   0-edge      virtio0-config",
		"E2E-IRQ before  25:          3         40  PCI-MSIX-0000:00:02.0   1-edge      virtio0-hiprio",
		"E2E-IRQ before  26:        100          0  PCI-MSIX-0000:00:02.0   2-edge      virtio0-requests.0",
		"E2E-IRQ before  27:          0         77  PCI-MSIX-0000:00:02.0   3-edge      virtio0-requests.1",
		"E2E-IRQ after  24:          0          0  PCI-MSIX-0000:00:02.0   0-edge      virtio0-config",
		"E2E-IRQ after  25:          3        161  PCI-MSIX-0000:00:02.0   1-edge      virtio0-hiprio",
		"E2E-IRQ after  26:        766          0  PCI-MSIX-0000:00:02.0   2-edge      virtio0-requests.0",
		"E2E-IRQ after  27:          2        913  PCI-MSIX-0000:00:02.0   3-edge      virtio0-requests.1",
	}
	got, out := irqDeltas(lines)
	want := map[string]int64{"config": 0, "hiprio": 121, "requests.0": 666, "requests.1": 838}
	if !reflect.DeepEqual(got, want) || len(out) != 4 || out[3] != "virtio0-requests.1: 838 (per CPU 2+836)" {
		t.Fatalf("irqDeltas: %v %q", got, out)
	}
	for v, ok := range map[string]bool{"6.12.117+deb12-cloud-amd64": true, "6.11.0": true, "6.1.0-57-cloud-amd64": false, "7.0.1": true, "5.19.2": false, "x": false} {
		if kernelAtLeast(v, 6, 11) != ok {
			t.Errorf("kernelAtLeast(%q, 6, 11) = %v", v, !ok)
		}
	}
}
