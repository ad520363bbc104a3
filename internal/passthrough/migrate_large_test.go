package passthrough

import (
	"bytes"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// vmHWM resets the process's peak RSS and returns a function that reports
// the peak since, in KiB.
func vmHWM(t *testing.T) func() int {
	os.WriteFile("/proc/self/clear_refs", []byte("5"), 0) // resets VmHWM
	return func() int {
		b, err := os.ReadFile("/proc/self/status")
		if err != nil {
			return -1
		}
		for l := range strings.SplitSeq(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "VmHWM:"); ok {
				n, _ := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")))
				return n
			}
		}
		return -1
	}
}

// TestMigrateLarge saves and loads 100,000 inodes and 10,000 handles and
// reports the cost. It takes about 25 s here, 80 s with -race (whose
// figures say nothing): skipped under -short, a tenth of the size under
// -race unless PT_MIGRATE_LARGE=1.
func TestMigrateLarge(t *testing.T) {
	if testing.Short() {
		t.Skip("short: 100k inodes")
	}
	if os.Getenv("PT_FILE_HANDLES") != "" || os.Getenv("PT_FD_BUDGET") != "" {
		t.Skip("once is enough") // TestAllInVariants reruns the suite
	}
	dirs, perDir, handles := 100, 1000, 10000
	if raceEnabled && os.Getenv("PT_MIGRATE_LARGE") != "1" {
		dirs, handles = 10, 1000
	}
	// Outside file handle mode, source and destination each hold an
	// O_PATH fd per inode; both hold an fd per handle. Where
	// RLIMIT_NOFILE cannot be raised that far (a container's hard limit),
	// the inodes are held as file handles and the source's handles are
	// closed before the load, as a source that has handed over would.
	opts := Options{}
	need := uint64(2*(dirs*perDir+dirs+handles) + 1000)
	if n, _ := RaiseNofileLimit(need); n < need {
		if n < uint64(handles+2000) {
			t.Skipf("RLIMIT_NOFILE %d", n)
		}
		opts.InodeFileHandles = FileHandlesMandatory
		t.Logf("RLIMIT_NOFILE %d: inodes held as file handles", n)
	}
	src := newTestFS(t, opts)
	start := time.Now()
	var fhs []uint64
	var nodes []uint64
	for d := range dirs {
		dn := fmt.Sprintf("dir%03d", d)
		os.Mkdir(src.path(dn), 0o755)
		for k := range perDir {
			f, err := os.Create(src.path(fmt.Sprintf("%s/file-%05d", dn, k)))
			if err != nil {
				t.Fatal(err)
			}
			f.Close()
		}
		did := src.lookup(rootID, dn).NodeId
		for k := range perDir {
			id := src.lookup(did, fmt.Sprintf("file-%05d", k)).NodeId
			if len(fhs) < handles {
				fhs = append(fhs, src.open(id, unix.O_RDONLY))
			}
			nodes = append(nodes, id)
		}
	}
	t.Logf("set-up: %d inodes, %d handles in %v", src.Stats().Inodes, src.Stats().Handles, time.Since(start))

	var ms0, ms1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms0)
	peak := vmHWM(t)
	start = time.Now()
	src.PrepareMigration()
	<-src.mig.cur.done
	collect := time.Since(start)
	start = time.Now()
	b := save(t, src.FS)
	saveTime := time.Since(start)
	runtime.ReadMemStats(&ms1)
	t.Logf("source: collect %v (background), SaveState %v, stream %d bytes (%.1f MB), alloc %.1f MB, heap in use +%.1f MB, peak RSS (VmHWM) %d MB",
		collect, saveTime, len(b), float64(len(b))/1e6, float64(ms1.TotalAlloc-ms0.TotalAlloc)/1e6,
		(float64(ms1.HeapInuse)-float64(ms0.HeapInuse))/1e6, peak()/1024)
	src.CancelMigration()
	srcStats := src.Stats()
	if opts.InodeFileHandles != FileHandlesNever {
		for k, fh := range fhs {
			src.release(nodes[k], fh)
		}
	}

	dst := newDest(t, src, opts)
	runtime.GC()
	runtime.ReadMemStats(&ms0)
	peak = vmHWM(t)
	start = time.Now()
	if err := dst.LoadState(bytes.NewReader(b), restoreCaps(src.caps.Load())); err != nil {
		t.Fatal(err)
	}
	loadTime := time.Since(start)
	runtime.ReadMemStats(&ms1)
	t.Logf("destination: LoadState %v, alloc %.1f MB, heap in use +%.1f MB, peak RSS (VmHWM) %d MB",
		loadTime, float64(ms1.TotalAlloc-ms0.TotalAlloc)/1e6, (float64(ms1.HeapInuse)-float64(ms0.HeapInuse))/1e6, peak()/1024)

	if s, d := srcStats, dst.Stats(); s.Inodes != d.Inodes || s.Handles != d.Handles || d.Inodes != dirs*perDir+dirs {
		t.Fatalf("source %+v, destination %+v", s, d)
	}
	for k := 0; k < len(nodes); k += 997 {
		dst.getattr(nodes[k])
		if k < len(fhs) {
			dst.read(nodes[k], fhs[k], 0, 1)
		}
	}
}
