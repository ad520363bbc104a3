package bench

import (
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/internal/fuse"
	"github.com/govirtiofsd/govirtiofsd/internal/passthrough"
	"github.com/govirtiofsd/govirtiofsd/internal/vhostuser"
)

// BenchmarkPipeline runs the daemon's whole request path in this process —
// pop from a vhost-user ring, FUSE decode, one pwritev/preadv straight from
// or into guest memory on a tmpfs share, push and notify — driven by the
// direct front end at depth 16, with the default worker budget, through one
// request ring (and, for 4 KiB random writes, also two). It reports
// the rate and the heap allocations per request counted over the
// measurement window for the whole process: the front end's own
// allocations are included, so the daemon's share is at most that.
func BenchmarkPipeline(b *testing.B) {
	for _, c := range []struct {
		w     Workload
		rings int
	}{
		{Workload{Name: "write-1M-4files", Kind: SeqWrite, Size: 1 << 20, Files: 4}, 1},
		{Workload{Name: "read-1M-4files", Kind: SeqRead, Size: 1 << 20, Files: 4}, 1},
		{Workload{Name: "randwrite-4k", Kind: RandWrite, Size: 4 << 10, Files: 4}, 1},
		{Workload{Name: "randwrite-4k-2q", Kind: RandWrite, Size: 4 << 10, Files: 4}, 2},
		{Workload{Name: "randread-4k", Kind: RandRead, Size: 4 << 10, Files: 4}, 1},
		{Workload{Name: "meta", Kind: Meta}, 1},
	} {
		b.Run(c.w.Name, func(b *testing.B) { benchPipeline(b, c.w, c.rings) })
	}
}

func benchPipeline(b *testing.B, w Workload, rings int) {
	o := &SuiteOptions{Dir: b.TempDir(), FileSize: 64 << 20, Depth: 16, QueueSize: 1024}
	fsys, log := benchFileSystem(b, o)
	srv := fuse.NewServer(fsys, fuse.ServerOptions{}, log)
	backend, err := vhostuser.NewBackend(vhostuser.Config{RequestQueues: rings, Tag: "bench", Logger: log,
		Workers: max(pipelineCPUs-1, 1), RingsWatched: reservePipelineProcs,
		Handler: vhostuser.HandlerFunc(func(i int) vhostuser.RequestHandler { return srv.Queue(i) })})
	if err != nil {
		b.Fatal(err)
	}
	sock := filepath.Join(o.Dir, "vhost.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		b.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- backend.ServeFirst(l) }()
	t, err := Connect(sock, TargetOptions(rings, o.QueueSize, bufMiB(o.Depth, max(w.Size, 4096))), o.files(), o.FileSize)
	if err != nil {
		b.Fatal(err)
	}
	var m0, m1 runtime.MemStats
	res, err := Run(t, RunSpec{Workload: w, Depth: o.Depth, Warmup: 300 * time.Millisecond, Duration: time.Second,
		Prefix:  "pipeline",
		OnStart: func() { runtime.ReadMemStats(&m0) },
		OnStop:  func() { runtime.ReadMemStats(&m1) }})
	t.Close()
	if err != nil {
		b.Fatal(err)
	}
	if err := <-served; err != nil {
		b.Logf("back end: %v", err)
	}
	if res.Ops == 0 {
		b.Fatal("no request completed")
	}
	secs := res.Elapsed.Seconds()
	b.ReportMetric(float64(res.Elapsed.Nanoseconds())/float64(res.Ops), "ns/op")
	b.ReportMetric(float64(res.Ops)/secs, "req/s")
	if w.Kind != Meta {
		b.ReportMetric(float64(res.Bytes)/secs/1e6, "MB/s")
	}
	b.ReportMetric(float64(m1.Mallocs-m0.Mallocs)/float64(res.Ops), "allocs/req")
	b.ReportMetric(float64(m1.TotalAlloc-m0.TotalAlloc)/float64(res.Ops), "B/req")
}

// The daemon's default worker budget and Ps (cmd/govirtiofsd, procs.go):
// a worker fewer than the CPUs, and a P more than the CPUs for each ring
// watched.
var pipelineCPUs = runtime.GOMAXPROCS(0)

func reservePipelineProcs(n int) {
	if p := pipelineCPUs + n; p > runtime.GOMAXPROCS(0) {
		runtime.GOMAXPROCS(p)
	}
}

// benchFileSystem prepares o's share (removed when b ends) and returns the
// passthrough file system serving it with cache=never, as the side-by-side
// run's daemons, and its discarding logger.
func benchFileSystem(b *testing.B, o *SuiteOptions) (*passthrough.FS, *slog.Logger) {
	cleanup, err := prepareShare(o)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(cleanup)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	fsys, err := passthrough.New(o.Share, passthrough.Options{Cache: passthrough.CacheNever}, log)
	if err != nil {
		b.Fatal(err)
	}
	return fsys, log
}
