package fuse

import (
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
)

// TestMetrics serves a known mix of requests on two queues and checks every
// figure of the scrape: counts, errors, histogram consistency, bytes.
func TestMetrics(t *testing.T) {
	fs := newFakeFS()
	fs.data = []byte("0123456789abcdefghij")
	s := NewServer(fs, ServerOptions{Metrics: true}, quietLogger())
	q1, q2 := s.Queue(1), s.Queue(2)
	serve(t, q1, initReq(1, 7, 38, kernelInitFlags, kernelInitFlags2, 64), 0, 80, 0)

	readIn := gofuse.ReadIn{Fh: 3, Offset: 10, Size: 5}
	writeIn := gofuse.WriteIn{Fh: 3, Offset: 0, Size: 11}
	for i := 0; i < 3; i++ {
		serve(t, q1, mkreq(OpRead, uint64(10+i), argBytes(readIn, 40), nil, nil), 0, 64, 0)
		serve(t, q2, mkreq(OpWrite, uint64(20+i), argBytes(writeIn, 40), nil, []byte("hello world")), 0, 64, 0)
	}
	serve(t, q2, mkreq(OpGetattr, 30, argBytes(gofuse.GetAttrIn{}, 16), nil, nil), 0, 256, 0)
	fs.errno = syscall.ENOENT
	serve(t, q1, mkreq(OpGetattr, 31, argBytes(gofuse.GetAttrIn{}, 16), nil, nil), 0, 256, 0)
	serve(t, q1, mkreq(OpForget, 32, argBytes(gofuse.ForgetIn{Nlookup: 1}, 8), nil, nil), 0, 64, 0)
	serve(t, q1, mkreq(200, 33, nil, nil, nil), 0, 64, 0)

	var b strings.Builder
	if err := s.WriteMetrics(&b); err != nil {
		t.Fatal(err)
	}
	text := b.String()
	want := map[string]uint64{
		`govirtiofsd_fuse_requests_total{opcode="INIT"}`:                               1,
		`govirtiofsd_fuse_requests_total{opcode="READ"}`:                               3,
		`govirtiofsd_fuse_requests_total{opcode="WRITE"}`:                              3,
		`govirtiofsd_fuse_requests_total{opcode="GETATTR"}`:                            2,
		`govirtiofsd_fuse_requests_total{opcode="FORGET"}`:                             1,
		`govirtiofsd_fuse_requests_total{opcode="unknown"}`:                            1,
		`govirtiofsd_fuse_errors_total{opcode="GETATTR"}`:                              1,
		`govirtiofsd_fuse_errors_total{opcode="FORGET"}`:                               0, // no reply is no error
		`govirtiofsd_fuse_errors_total{opcode="unknown"}`:                              1, // ENOSYS
		`govirtiofsd_fuse_errors_total{opcode="READ"}`:                                 0,
		`govirtiofsd_fuse_request_duration_seconds_count{opcode="READ"}`:               3,
		`govirtiofsd_fuse_request_duration_seconds_bucket{opcode="WRITE",le="+Inf"}`:   3,
		`govirtiofsd_fuse_request_duration_seconds_bucket{opcode="GETATTR",le="+Inf"}`: 2,
		`govirtiofsd_read_bytes_total`:                                                 15,
		`govirtiofsd_written_bytes_total`:                                              33,
	}
	got := map[string]uint64{}
	for _, line := range strings.Split(text, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			t.Fatalf("malformed line %q", line)
		}
		if strings.Contains(line, "_sum{") {
			if _, err := strconv.ParseFloat(line[i+1:], 64); err != nil {
				t.Errorf("line %q: %v", line, err)
			}
			continue
		}
		v, err := strconv.ParseUint(line[i+1:], 10, 64)
		if err != nil {
			t.Fatalf("line %q: %v", line, err)
		}
		got[line[:i]] = v
	}
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			t.Errorf("%s = %d (present %v), want %d", k, g, ok, v)
		}
	}
	if _, ok := got[`govirtiofsd_fuse_requests_total{opcode="LOOKUP"}`]; ok {
		t.Error("an opcode never seen is listed")
	}
	// Cumulative buckets never decrease and end at the count.
	bucket := regexp.MustCompile(`^govirtiofsd_fuse_request_duration_seconds_bucket\{opcode="([A-Z]+|unknown)",le="([^"]+)"\}$`)
	last := map[string]uint64{}
	for _, line := range strings.Split(text, "\n") {
		i := strings.LastIndexByte(line, ' ')
		if i < 0 || !bucket.MatchString(line[:i]) {
			continue
		}
		op := bucket.FindStringSubmatch(line[:i])[1]
		v := got[line[:i]]
		if v < last[op] {
			t.Errorf("bucket %s decreases", line)
		}
		last[op] = v
	}
	if len(last) != 6 {
		t.Errorf("histograms for %d opcodes, want 6", len(last))
	}
}

// TestMetricsOff: without the option a queue keeps no stats and a scrape
// is empty of samples.
func TestMetricsOff(t *testing.T) {
	fs := newFakeFS()
	s, q := newSession(t, fs)
	if q.st != nil {
		t.Fatal("stats kept with metrics off")
	}
	var b strings.Builder
	s.WriteMetrics(&b)
	for _, line := range strings.Split(b.String(), "\n") {
		if line != "" && !strings.HasPrefix(line, "#") && !strings.HasSuffix(line, " 0") {
			t.Errorf("sample with metrics off: %q", line)
		}
	}
}
