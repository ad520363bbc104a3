package passthrough

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// BenchmarkInodeMemory interns n inodes — a LOOKUP of each of n files in
// one directory, each kept, as a guest's dentry cache holds them — and
// reports the Go heap they keep alive: live bytes per inode after a
// collection (B/inode), heap objects per inode (objs/inode) and the time
// per LOOKUP. It is the inode table's share of the daemon's RssAnon per
// inode (make bench-scale measures the whole daemon). With fds the share
// is limited by RLIMIT_NOFILE, so that mode runs at 10k only;
// PT_BENCH_INODES=N adds a file handle run of N inodes (1000000: some
// 300 MB of tmpfs inodes and dentries, and a minute or two).
func BenchmarkInodeMemory(b *testing.B) {
	type run struct {
		mode FileHandleMode
		n    int
	}
	runs := []run{{FileHandlesNever, 10_000}, {FileHandlesPrefer, 10_000}, {FileHandlesPrefer, 100_000}}
	if n, err := strconv.Atoi(os.Getenv("PT_BENCH_INODES")); err == nil && n > 0 {
		runs = append(runs, run{FileHandlesPrefer, n})
	}
	for _, c := range runs {
		name := map[FileHandleMode]string{FileHandlesNever: "fd", FileHandlesPrefer: "handle"}[c.mode]
		b.Run(fmt.Sprintf("%s/%dk", name, c.n/1000), func(b *testing.B) {
			dir := manyFiles(b, c.n)
			names := make([][]byte, c.n)
			for i := range names {
				names[i] = []byte(fmt.Sprint(i))
			}
			var live, objs float64
			for b.Loop() {
				b.StopTimer()
				f, err := New(dir, Options{InodeFileHandles: c.mode}, testLog)
				if err != nil {
					b.Fatal(err)
				}
				f.Init(f.Capabilities())
				var m0, m1 runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&m0)
				b.StartTimer()
				var e gofuse.EntryOut
				for _, name := range names {
					if errno := f.Lookup(hdr(rootID), name, &e); errno != 0 {
						b.Fatalf("lookup %s: %v", name, errno)
					}
				}
				b.StopTimer()
				runtime.GC()
				runtime.ReadMemStats(&m1)
				live = float64(m1.HeapAlloc-m0.HeapAlloc) / float64(c.n)
				objs = float64(m1.HeapObjects-m0.HeapObjects) / float64(c.n)
				runtime.KeepAlive(f)
				f.Close()
				b.StartTimer()
			}
			b.ReportMetric(live, "B/inode")
			b.ReportMetric(objs, "objs/inode")
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*c.n), "ns/lookup")
		})
	}
}

// manyFiles makes a directory of n empty files named 0 .. n-1 (shmTempDir).
func manyFiles(tb testing.TB, n int) string {
	dir := shmTempDir(tb, "passthrough-inodes")
	for i := range n {
		if err := unix.Mknod(filepath.Join(dir, fmt.Sprint(i)), unix.S_IFREG|0o644, 0); err != nil {
			tb.Fatal(err)
		}
	}
	return dir
}

// shmTempDir makes a directory removed when the test ends, on tmpfs
// (/dev/shm) where there is one, as the shares the benchmarks measure are.
func shmTempDir(tb testing.TB, pattern string) string {
	base := "/dev/shm"
	if st, err := os.Stat(base); err != nil || !st.IsDir() {
		base = tb.TempDir()
	}
	dir, err := os.MkdirTemp(base, pattern)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
