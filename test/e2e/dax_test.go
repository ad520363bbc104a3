//go:build linux

package e2e

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// DAX through QEMU 11.1's shared-memory window (DESIGN.md §13, issue 33):
// the generic vhost-user device (vmConfig.Generic) with our daemon at
// --cache-size, the Linux 7.x guest mounting with dax=always and dax=inode.

// daxWindow is the window TestDAX gives the daemon (--cache-size).
const daxWindow = "64M"

// daxSizes are the file sizes of TestDAX: empty, one byte, a page less one
// and a page, a 2 MiB slot less one, one slot and a slot plus one (the last
// partial slot), and a file larger than twice the window (remapping);
// -1 stands for daxBigSize().
var daxSizes = []int64{0, 1, 4095, 4096, 2<<20 - 1, 2 << 20, 2<<20 + 1, -1}

// daxBigSize is the large file of TestDAX: 100 MiB + 7 bytes unless
// GOVIRTIOFSD_E2E_DAX_BIG says otherwise (bytes).
func daxBigSize() int64 {
	if s := os.Getenv("GOVIRTIOFSD_E2E_DAX_BIG"); s != "" {
		if n, err := strconv.ParseInt(s, 0, 64); err == nil && n > 0 {
			return n
		}
	}
	return 100<<20 + 7
}

func daxSizeList() []int64 {
	out := make([]int64, len(daxSizes))
	for i, s := range daxSizes {
		if s < 0 {
			s = daxBigSize()
		}
		out[i] = s
	}
	return out
}

// genStream writes what `fsops gen SEED N` prints (guest-tools/fsops.c:
// xorshift64*, little-endian words) to w.
func genStream(w io.Writer, seed uint64, n int64) error {
	x := seed*0x9E3779B97F4A7C15 + 1
	buf := make([]byte, 1<<16)
	for n > 0 {
		k := min(int64(len(buf)), n)
		for i := int64(0); i < k; i += 8 {
			x ^= x >> 12
			x ^= x << 25
			x ^= x >> 27
			var v [8]byte
			binary.LittleEndian.PutUint64(v[:], x*0x2545F4914F6CDD1D)
			copy(buf[i:k], v[:])
		}
		if _, err := w.Write(buf[:k]); err != nil {
			return err
		}
		n -= k
	}
	return nil
}

func genSHA(seed uint64, n int64) string {
	h := sha256.New()
	_ = genStream(h, seed, n)
	return hex.EncodeToString(h.Sum(nil))
}

func fileSHA(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		return "open: " + err.Error()
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "read: " + err.Error()
	}
	return hex.EncodeToString(h.Sum(nil))
}

// writeRandomFile writes n pseudo-random bytes (seeded by n) to path and
// returns their sha256.
func writeRandomFile(t *testing.T, path string, n int64) string {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	h := sha256.New()
	r := rand.New(rand.NewPCG(uint64(n), 33))
	buf := make([]byte, 1<<16)
	for left := n; left > 0; {
		k := min(int64(len(buf)), left)
		for i := range buf[:k] {
			buf[i] = byte(r.Uint32())
		}
		if _, err := f.Write(buf[:k]); err != nil {
			t.Fatal(err)
		}
		h.Write(buf[:k])
		left -= k
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// daemonHelpHas reports whether our daemon's --help lists flag.
func daemonHelpHas(t *testing.T, flag string) bool {
	t.Helper()
	return strings.Contains(ourDaemonHelp(t), flag)
}

// converse answers the guest's questions (E2E-ASK) with handle's answers
// until QEMU exits or timeout passes.
func (v *vm) converse(timeout time.Duration, handle func(q string) string) {
	v.t.Helper()
	deadline := time.Now().Add(timeout)
	answered := 0
	for {
		var asks []string
		for _, l := range v.consoleLines() {
			if m := reAsk.FindStringSubmatch(l); m != nil {
				asks = append(asks, m[1])
			}
		}
		for answered < len(asks) {
			v.answer(handle(asks[answered]))
			answered++
		}
		if !v.Running() {
			return
		}
		if time.Now().After(deadline) {
			v.t.Fatalf("guest still running after %v\n%s", timeout, lastLines(v.consoleLines(), 25))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// logCuts records the daemon log's length when the guest asks
// "NAME-begin" and "NAME-end" (the guest is idle while it asks).
type logCuts struct {
	d     *daemon
	t     *testing.T
	spans map[string][2]int64
}

func newLogCuts(t *testing.T, d *daemon) *logCuts {
	return &logCuts{d: d, t: t, spans: map[string][2]int64{}}
}

func (c *logCuts) note(q string) bool {
	name, begin := strings.CutSuffix(q, "-begin")
	if !begin {
		var end bool
		if name, end = strings.CutSuffix(q, "-end"); !end {
			return false
		}
	}
	if c.d.kind != ourDaemon {
		return true
	}
	time.Sleep(300 * time.Millisecond)
	sp := c.spans[name]
	if begin {
		sp[0] = c.d.logSize(c.t)
	} else {
		sp[1] = c.d.logSize(c.t)
	}
	c.spans[name] = sp
	return true
}

// daxCounts is what the daemon's debug log shows of one mount.
type daxCounts struct {
	FUSE      map[string]int // requests per opcode
	FUSEErr   map[string]int // of which answered with an error
	VhostUser map[string]int // front-end messages per request name
	ShmemMap  int            // lines naming SHMEM_MAP (the back-end requests)
	ShmemUnm  int            // lines naming SHMEM_UNMAP
	Warnings  []string       // WARN and ERROR lines
}

var (
	reShmemMap   = regexp.MustCompile(`SHMEM_MAP\b`)
	reShmemUnmap = regexp.MustCompile(`SHMEM_UNMAP\b`)
)

// daxLogCounts counts, in our daemon's log between two offsets, the FUSE
// requests, the vhost-user messages and the SHMEM_MAP / SHMEM_UNMAP lines.
func daxLogCounts(t *testing.T, d *daemon, from, to int64) daxCounts {
	t.Helper()
	c := daxCounts{FUSE: map[string]int{}, FUSEErr: map[string]int{}, VhostUser: map[string]int{}}
	data, err := os.ReadFile(d.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	if to < 0 || to > int64(len(data)) {
		to = int64(len(data))
	}
	for _, line := range strings.Split(string(data[min(from, to):to]), "\n") {
		kv := parseLogfmt(line)
		switch kv["msg"] {
		case "fuse request":
			c.FUSE[kv["opcode"]]++
			if kv["error"] != "" && kv["error"] != "0" {
				c.FUSEErr[kv["opcode"]]++
			}
			continue
		case "vhost-user message":
			c.VhostUser[kv["request"]]++
		}
		if lv := kv["level"]; lv == "WARN" || lv == "ERROR" {
			c.Warnings = append(c.Warnings, line)
		}
		if reShmemMap.MatchString(line) {
			c.ShmemMap++
		}
		if reShmemUnmap.MatchString(line) {
			c.ShmemUnm++
		}
	}
	return c
}

// daxRun is one boot of guest-scripts/dax.sh.
type daxRun struct {
	kind    daemonKind
	extra   []string // daemon arguments
	modes   []string // dax.sh's e2e.daxmodes
	window  bool     // the daemon offers a window: DAX is required
	fio     bool
	queues  int // the generic device's request queues (0: 1)
	sizes   []int64
	e       *env
	v       *vm
	cuts    *logCuts
	hostSHA map[int64]string
	results map[string]string
	took    time.Duration
}

// runDAXScript boots the 7.x guest on QEMU 11 with the generic device and
// runs dax.sh, then checks every size in every mode.
func runDAXScript(t *testing.T, k guestKernel, r *daxRun) {
	t.Helper()
	r.sizes = daxSizeList()
	shared := t.TempDir()
	r.hostSHA = map[int64]string{}
	for _, s := range r.sizes {
		r.hostSHA[s] = writeRandomFile(t, filepath.Join(shared, fmt.Sprintf("h-%d", s)), s)
	}
	r.e = newEnvAt(t, r.kind, k, shared, r.extra...)
	sizes := make([]string, len(r.sizes))
	for i, s := range r.sizes {
		sizes[i] = strconv.FormatInt(s, 10)
	}
	fio := "0"
	if r.fio {
		fio = "1"
	}
	timeout := max(vmTimeout(), 6*time.Minute)
	start := time.Now()
	r.v = r.e.start(vmConfig{QEMU: qemu11, Generic: true, GenericQueues: r.queues, Script: "dax", Timeout: timeout,
		Append: []string{"e2e.mount=0", "e2e.daxmodes=" + strings.Join(r.modes, ","), "e2e.daxsizes=" + strings.Join(sizes, ","),
			"e2e.daxfio=" + fio}})
	r.cuts = newLogCuts(t, r.e.d)
	r.v.converse(timeout, func(q string) string {
		r.cuts.note(q)
		return "ok"
	})
	r.took = time.Since(start)
	r.v.waitExit()
	r.e.daemonExit(r.v, r.kind == ourDaemon)
	r.check(t)
}

func (r *daxRun) check(t *testing.T) {
	t.Helper()
	lines := r.v.consoleLines()
	g := parseConsole(lines)
	r.results = map[string]string{}
	for _, l := range lines {
		if m := reResult.FindStringSubmatch(l); m != nil {
			r.results[m[1]] = strings.TrimSpace(m[2])
		}
		if m := reMismatch.FindStringSubmatch(l); m != nil {
			t.Errorf("guest: %s", l)
		}
	}
	stepRC := map[string]int{}
	for _, s := range g.Steps {
		stepRC[s.Name] = s.RC
		if s.RC != 0 {
			t.Errorf("guest step %s rc=%d:\n  %s", s.Name, s.RC, strings.Join(s.Output, "\n  "))
		}
	}
	cl := g.step(t, 1, "cachelen")
	cacheLine := strings.Join(cl.Output, " ")
	if r.window {
		if !strings.Contains(strings.ToLower(cacheLine), "cache len: 0x4000000") {
			t.Errorf("guest did not log the 64 MiB window (want \"Cache len: 0x4000000\"): %q", cacheLine)
		}
	} else if !strings.Contains(cacheLine, "no Cache len line") {
		t.Errorf("no window offered, yet the guest logged %q", cacheLine)
	}
	t.Logf("guest: %s", cacheLine)

	var table strings.Builder
	fmt.Fprintf(&table, "| size | %s |\n| --- |%s\n", strings.Join(r.modes, " | "), strings.Repeat(" --- |", len(r.modes)))
	for _, s := range r.sizes {
		row := []string{strconv.FormatInt(s, 10)}
		for _, mode := range r.modes {
			key := fmt.Sprintf("dax.%s.%d.", mode, s)
			var bad []string
			if _, ok := stepRC["mount-"+mode]; !ok {
				bad = append(bad, "not mounted")
			}
			if got := r.results[key+"hostread"]; got != r.hostSHA[s] {
				bad = append(bad, "read")
				t.Errorf("%s %d: the guest read h-%d as %s, the host wrote %s", mode, s, s, got, r.hostSHA[s])
			}
			want := genSHA(2, s)
			if got := r.results[key+"gen"]; got != want {
				t.Errorf("%s %d: the guest's fsops gen gave %s, the host's %s (gen differs: fix genStream)", mode, s, got, want)
			}
			if got := r.results[key+"guestread"]; got != want {
				bad = append(bad, "write (guest)")
				t.Errorf("%s %d: the guest read back its file as %s, want %s", mode, s, got, want)
			}
			if got := fileSHA(t, filepath.Join(r.e.shared, fmt.Sprintf("g-%s-%d", mode, s))); got != want {
				bad = append(bad, "write (host)")
				t.Errorf("%s %d: the host reads the guest's file as %s, want %s", mode, s, got, want)
			}
			if rc, ok := stepRC[fmt.Sprintf("files-%s-%d", mode, s)]; !ok || rc != 0 {
				bad = append(bad, "files step")
			}
			if r.fio && s > 0 {
				if rc, ok := stepRC[fmt.Sprintf("fio-%s-%d", mode, s)]; !ok || rc != 0 {
					bad = append(bad, "fio")
				}
			}
			attr := r.results[key+"attr"]
			dax := strings.Contains(attr, "dax=1")
			if r.window && (mode == "always" || mode == "inode") && !dax {
				bad = append(bad, "not DAX")
				t.Errorf("%s %d: the guest's file is not DAX (statx: %q)", mode, s, attr)
			}
			if !r.window && dax {
				t.Errorf("%s %d: DAX without a window? (statx: %q)", mode, s, attr)
			}
			cell := "ok"
			if len(bad) > 0 {
				cell = "FAIL: " + strings.Join(bad, ", ")
			}
			if dax {
				cell += " (dax)"
			}
			row = append(row, cell)
		}
		fmt.Fprintf(&table, "| %s |\n", strings.Join(row, " | "))
	}

	stepDur := r.v.stepDurations()
	var times strings.Builder
	for _, mode := range r.modes {
		var d time.Duration
		for name, sd := range stepDur {
			if strings.HasSuffix(name, "-"+mode) || strings.Contains(name, "-"+mode+"-") {
				d += sd
			}
		}
		fmt.Fprintf(&times, "%s %.1fs; ", mode, d.Seconds())
	}
	t.Logf("%s, %s: QEMU ran %.1fs (guest work per mode: %s)", r.kind, strings.Join(r.extra, " "), r.took.Seconds(), times.String())
	big := daxBigSize()
	for _, mode := range r.modes {
		t.Logf("  %s: files %d B %.1fs, fio %d B %.1fs", mode, big, stepDur[fmt.Sprintf("files-%s-%d", mode, big)].Seconds(),
			big, stepDur[fmt.Sprintf("fio-%s-%d", mode, big)].Seconds())
	}

	var counts strings.Builder
	if r.kind == ourDaemon {
		for _, mode := range r.modes {
			sp, ok := r.cuts.spans["dax-"+mode]
			if !ok || sp[1] <= sp[0] {
				t.Errorf("%s: no daemon log span (the guest's dax-%s-begin/-end asks)", mode, mode)
			}
			c := daxLogCounts(t, r.e.d, sp[0], sp[1])
			line := fmt.Sprintf("%s: FUSE SETUPMAPPING×%d (errors %d) REMOVEMAPPING×%d (errors %d) READ×%d WRITE×%d; vhost-user ADD_MEM_REG×%d REM_MEM_REG×%d SET_MEM_TABLE×%d; SHMEM_MAP lines %d, SHMEM_UNMAP lines %d",
				mode, c.FUSE["SETUPMAPPING"], c.FUSEErr["SETUPMAPPING"], c.FUSE["REMOVEMAPPING"], c.FUSEErr["REMOVEMAPPING"],
				c.FUSE["READ"], c.FUSE["WRITE"], c.VhostUser["ADD_MEM_REG"], c.VhostUser["REM_MEM_REG"], c.VhostUser["SET_MEM_TABLE"],
				c.ShmemMap, c.ShmemUnm)
			t.Logf("daemon log, %s", line)
			counts.WriteString(line + "\n")
			for _, w := range c.Warnings {
				t.Errorf("%s: daemon warning: %s", mode, w)
			}
			if !r.window {
				if c.FUSE["SETUPMAPPING"] > 0 {
					t.Errorf("%s: SETUPMAPPING without a window", mode)
				}
				continue
			}
			if mode != "always" && mode != "inode" {
				continue
			}
			if c.FUSE["SETUPMAPPING"] == 0 || c.VhostUser["ADD_MEM_REG"] == 0 {
				t.Errorf("%s: DAX not used: no SETUPMAPPING or no ADD_MEM_REG in the daemon's log", mode)
			}
			if mode == "always" && c.FUSE["READ"] > 0 {
				t.Errorf("always: the daemon answered %d READ requests (every file is DAX: want none)", c.FUSE["READ"])
			}
		}
	}
	t.Logf("DAX e2e table (%s %s):\n%s", r.kind, strings.Join(r.extra, " "), table.String())
	_ = os.WriteFile(filepath.Join(r.e.dir, "dax-table.md"), []byte(table.String()+"\n"+counts.String()), 0o644)
}

// TestDAX (make test): our daemon with a 64 MiB window (--cache-size) on
// QEMU 11's generic device, the Linux 7.x guest with 2 vCPUs and the
// daemon's default --queues, one boot: dax=always, then (umount, mount)
// dax=inode. Per file size (daxSizes) and mode: the guest reads a host-made
// file, writes one (extending writes, then an overwrite in place) and
// reads it back after drop_caches, and runs fio write + verify; the sha256
// of each file is the same in the guest and on the host. The guest must log
// the window ("Cache len"), each file must be DAX (STATX_ATTR_DAX), the
// daemon's log must show SETUPMAPPING and ADD_MEM_REG in each mode and no
// READ under dax=always. The table (size × mode) goes to the test log and
// dax-table.md.
func TestDAX(t *testing.T) {
	requireE2E(t)
	peersBin(t, qemu11Wrapper)
	k := newestKernel7(t)
	if !daemonHelpHas(t, "--cache-size") {
		t.Fatalf("%s --help has no --cache-size (the DAX window, issue 33)", ourDaemonBinary(t))
	}
	r := &daxRun{kind: ourDaemon, extra: []string{"--tag", "myfs", "--cache-size", daxWindow}, modes: []string{"always", "inode"},
		window: true, fio: true}
	runDAXScript(t, k, r)
}

// TestDAXFull (make e2e-full) runs, on QEMU 11 with the generic device and
// the Linux 7.x guest:
//   - generic-rust114, generic-ours-queues1: the harness without a window
//     (dax.sh with a plain mount): the Rust virtiofsd 1.14 and ours at
//     --queues 1 on the generic device (DESIGN.md §13's checks, nothing
//     about DAX but that it is absent);
//   - mmap: guest-scripts/dax-mmap.sh's coherence part on ours with the
//     window: a host write seen in the guest's live MAP_SHARED mapping, a
//     guest store seen by a host read (recorded before msync, required
//     after), truncate and unlink of a mapped file from the guest and an
//     unlink from the host, a second mount in the same boot (the daemon
//     must drop QEMU's old mappings at INIT), then a reboot with live
//     mappings and a third mount after it; every host-made file must read
//     back the same in each mount;
//   - hosttrunc: the host truncates a file under a live guest mapping; what
//     happens (guest SIGBUS, QEMU dying...) is recorded, not required: the
//     daemon cannot prevent a host process from truncating a shared file.
func TestDAXFull(t *testing.T) {
	if os.Getenv("GOVIRTIOFSD_E2E_FULL") != "1" {
		t.Skip("set GOVIRTIOFSD_E2E_FULL=1 (make e2e-full)")
	}
	requireE2E(t)
	peersBin(t, qemu11Wrapper)
	k := newestKernel7(t)
	t.Run("generic-rust114", func(t *testing.T) {
		peersBin(t, rust114Name)
		runDAXScript(t, k, &daxRun{kind: rust114Daemon, extra: []string{"--tag", "myfs"}, modes: []string{"none"}, fio: true})
	})
	t.Run("generic-ours-queues1", func(t *testing.T) {
		runDAXScript(t, k, &daxRun{kind: ourDaemon, extra: []string{"--tag", "myfs", "--queues", "1"}, modes: []string{"none"}, fio: true})
	})
	if !daemonHelpHas(t, "--cache-size") {
		t.Fatalf("%s --help has no --cache-size (the DAX window, issue 33)", ourDaemonBinary(t))
	}
	t.Run("mmap", func(t *testing.T) { daxMmapCoherence(t, k) })
	t.Run("hosttrunc", func(t *testing.T) { daxHostTruncate(t, k) })
}

// daxMmapShare makes dax-mmap.sh's host files.
func daxMmapShare(t *testing.T) (string, map[string]string) {
	t.Helper()
	shared := t.TempDir()
	sums := map[string]string{}
	for _, s := range []int64{1, 4096, 2<<20 + 1, 8<<20 + 3} {
		name := fmt.Sprintf("h-%d", s)
		sums[name] = writeRandomFile(t, filepath.Join(shared, name), s)
	}
	for name, data := range map[string][]byte{
		"c1":  []byte(strings.Repeat("a", 8192)),
		"c2":  []byte(strings.Repeat("b", 5000)), // its second page is a tail
		"t1":  []byte(strings.Repeat("t", 8192)),
		"u1":  []byte(strings.Repeat("u", 8192)),
		"hu1": []byte(strings.Repeat("h", 8192)),
		"ht1": []byte(strings.Repeat("T", 4<<20)),
	} {
		if err := os.WriteFile(filepath.Join(shared, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return shared, sums
}

func daxResults(lines []string, prefix string) map[string]string {
	out := map[string]string{}
	for _, l := range lines {
		if m := reResult.FindStringSubmatch(l); m != nil && strings.HasPrefix(m[1], prefix) {
			out[strings.TrimPrefix(m[1], prefix)] = strings.TrimSpace(m[2])
		}
	}
	return out
}

// hostReadAt reads n bytes at off of path on the host.
func hostReadAt(path string, off int64, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return "open: " + err.Error()
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		return "read: " + err.Error()
	}
	return string(b)
}

func daxMmapCoherence(t *testing.T, k guestKernel) {
	shared, sums := daxMmapShare(t)
	e := newEnvAt(t, ourDaemon, k, shared, "--tag", "myfs", "--cache-size", daxWindow)
	timeout := max(vmTimeout(), 4*time.Minute)
	v := e.start(vmConfig{QEMU: qemu11, Generic: true, Script: "dax-mmap", Timeout: timeout, AllowReboot: true,
		Append: []string{"e2e.mount=0", "e2e.daxpart=coherence"}})
	cuts := newLogCuts(t, e.d)
	boots := 0
	var rebootAt int64
	c1 := filepath.Join(shared, "c1")
	v.converse(timeout, func(q string) string {
		cuts.note(q)
		switch q {
		case "dax-boot":
			boots++
			if boots == 2 {
				rebootAt = e.d.logSize(t)
				return "second"
			}
			return "first"
		case "host-write-c1":
			f, err := os.OpenFile(c1, os.O_WRONLY, 0)
			if err == nil {
				_, err = f.WriteAt([]byte("HOSTWROTE"), 100)
				f.Close()
			}
			if err != nil {
				t.Errorf("host write of c1: %v", err)
			}
			return "written"
		case "host-write-c2":
			f, err := os.OpenFile(filepath.Join(shared, "c2"), os.O_WRONLY, 0)
			if err == nil {
				_, err = f.WriteAt([]byte("HOSTTAIL"), 4200)
				f.Close()
			}
			if err != nil {
				t.Errorf("host write of c2: %v", err)
			}
			return "written"
		case "host-read-c1-nosync", "host-read-c1-sync":
			return "host-saw:" + hostReadAt(c1, 200, 10)
		case "host-unlink-hu1":
			if err := os.Remove(filepath.Join(shared, "hu1")); err != nil {
				t.Errorf("host unlink: %v", err)
			}
			return "unlinked"
		}
		return "ok"
	})
	v.waitExit()
	e.daemonExit(v, true)
	lines := v.consoleLines()
	res := daxResults(lines, "mmap.")
	g := parseConsole(lines)
	for _, s := range g.Steps {
		t.Logf("  boot %d step %s rc=%d", s.Boot, s.Name, s.RC)
		if s.RC != 0 && !(s.Name == "umount" && s.Boot == 1) {
			t.Errorf("boot %d step %s rc=%d: %v", s.Boot, s.Name, s.RC, s.Output)
		}
	}
	keys := make([]string, 0, len(res))
	for k := range res {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%s = %s\n", k, res[k])
	}
	t.Logf("dax-mmap results:\n%s", b.String())
	_ = os.WriteFile(filepath.Join(e.dir, "dax-mmap.txt"), []byte(b.String()), 0o644)

	want := map[string]func(string) bool{
		"host-write-seen":      func(s string) bool { return strings.HasPrefix(s, "seen") },
		"tail.host-write-seen": func(s string) bool { return strings.HasPrefix(s, "seen") },
		"guest-store":          func(s string) bool { return s == "ok" },
		"msync":                func(s string) bool { return s == "ok" },
		"host-read-sync":       func(s string) bool { return s == "host-saw:GUESTSTORE" },
		"gtrunc.ftrunc":        func(s string) bool { return s == "ok" },
		"gtrunc.read-below":    func(s string) bool { return s == "r:tttt" },
		"gtrunc.read-past":     func(s string) bool { return s == "SIGBUS" },
		"gtrunc.size":          func(s string) bool { return s == "4096" },
		"gunlink.rm":           func(s string) bool { return s == "ok" },
		"gunlink.read":         func(s string) bool { return s == "r:uuuu" },
		"gunlink.store":        func(s string) bool { return s == "ok" },
		"gunlink.reread":       func(s string) bool { return s == "r:UNLK" },
		"hunlink.read":         func(s string) bool { return s == "r:hhhh" },
		"c1.mount1":            func(s string) bool { return s == "HOSTWROTE" },
		"c1.mount2":            func(s string) bool { return s == "GUESTSTORE" },
		"c1.mount3":            func(s string) bool { return s == "HOSTWROTE" },
	}
	for _, mnt := range []string{"mount1", "mount2", "mount3"} {
		for name, sum := range sums {
			want[mnt+"."+name] = func(s string) bool { return s == sum }
		}
	}
	for key, ok := range want {
		got, present := res[key]
		if !present || !ok(got) {
			t.Errorf("mmap.%s = %q (present %v): not what DAX must give", key, got, present)
		}
	}
	if g.Boots != 2 {
		t.Errorf("guest booted %d times, want 2 (a reboot with live mappings)", g.Boots)
	}
	for name, sp := range cuts.spans {
		t.Logf("daemon log span %s: %v", name, sp)
	}
	all := daxLogCounts(t, e.d, 0, -1)
	t.Logf("daemon log, whole run: FUSE SETUPMAPPING×%d (errors %d) REMOVEMAPPING×%d INIT×%d; vhost-user ADD_MEM_REG×%d REM_MEM_REG×%d; SHMEM_MAP lines %d, SHMEM_UNMAP lines %d",
		all.FUSE["SETUPMAPPING"], all.FUSEErr["SETUPMAPPING"], all.FUSE["REMOVEMAPPING"], all.FUSE["INIT"], all.VhostUser["ADD_MEM_REG"],
		all.VhostUser["REM_MEM_REG"], all.ShmemMap, all.ShmemUnm)
	if rebootAt > 0 {
		after := daxLogCounts(t, e.d, rebootAt, -1)
		t.Logf("daemon log after the reboot: SETUPMAPPING×%d (errors %d), ADD_MEM_REG×%d REM_MEM_REG×%d", after.FUSE["SETUPMAPPING"],
			after.FUSEErr["SETUPMAPPING"], after.VhostUser["ADD_MEM_REG"], after.VhostUser["REM_MEM_REG"])
	}
	if all.FUSEErr["SETUPMAPPING"] > 0 {
		t.Errorf("%d SETUPMAPPING answered with an error (a remount or the reboot found QEMU's old mappings?)", all.FUSEErr["SETUPMAPPING"])
	}
}

func daxHostTruncate(t *testing.T, k guestKernel) {
	shared, _ := daxMmapShare(t)
	e := newEnvAt(t, ourDaemon, k, shared, "--tag", "myfs", "--cache-size", daxWindow)
	timeout := max(vmTimeout(), 3*time.Minute)
	v := e.start(vmConfig{QEMU: qemu11, Generic: true, Script: "dax-mmap", Timeout: timeout,
		Append: []string{"e2e.mount=0", "e2e.daxpart=hosttrunc"}})
	v.converse(timeout, func(q string) string {
		if q == "host-truncate-ht1" {
			if err := os.Truncate(filepath.Join(shared, "ht1"), 4096); err != nil {
				t.Errorf("host truncate: %v", err)
			}
			return "truncated"
		}
		return "ok"
	})
	<-v.Done()
	time.Sleep(100 * time.Millisecond)
	lines := v.consoleLines()
	res := daxResults(lines, "mmap.")
	var b strings.Builder
	for _, k := range []string{"htrunc.open", "htrunc.read-slot1", "htrunc.read-below", "htrunc.read-past-page",
		"htrunc.read-past-slot", "htrunc.store-past", "htrunc.size"} {
		fmt.Fprintf(&b, "%s = %q\n", k, res[k])
	}
	st := v.Status()
	fmt.Fprintf(&b, "QEMU: exit code %d, signal %v, err %v, done=%v\n", st.Code, st.Signal, v.Err(), countMatches(lines, reDone) > 0)
	fmt.Fprintf(&b, "console tail:\n%s\n", lastLines(lines, 12))
	e.daemonExit(v, false)
	fmt.Fprintf(&b, "daemon: exit code %d\n%s\n", e.d.Status().Code, tail(e.d.LogPath, 6))
	t.Logf("host truncate under a live guest DAX mapping:\n%s", b.String())
	_ = os.WriteFile(filepath.Join(e.dir, "dax-hosttrunc.txt"), []byte(b.String()), 0o644)
	if res["htrunc.read-slot1"] != "r:TTTT" || res["htrunc.read-below"] == "" {
		t.Errorf("the guest did not read ht1 through its mapping before the truncate (%q, %q)", res["htrunc.read-slot1"], res["htrunc.read-below"])
	}
}
