package integration

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// scrape fetches the metrics over a unix socket and returns the samples
// by name{labels}.
func scrape(t *testing.T, sock string) map[string]float64 {
	t.Helper()
	c := &http.Client{Timeout: opTimeout, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
	}}
	resp, err := c.Get("http://daemon/metrics")
	if err != nil {
		t.Fatalf("scrape: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain; version=0.0.4") {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("scrape: %s, %q: %s", resp.Status, resp.Header.Get("Content-Type"), b)
	}
	samples := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if i < 0 || err != nil {
			t.Fatalf("scrape: malformed line %q", line)
		}
		samples[line[:i]] = v
	}
	return samples
}

// TestMetrics drives known traffic on two rings and checks what the
// metrics endpoint reports: per-opcode counts and errors, bytes, per-ring
// completions, open inodes and handles; then that the socket is gone
// after SIGTERM.
func TestMetrics(t *testing.T) {
	msock := filepath.Join(t.TempDir(), "metrics.sock")
	d := startDaemon(t, "--queues", "2", "--metrics-addr", "unix:"+msock)
	o := opts()
	o.Queues = 3
	dev := d.connect(o)
	c1, c2 := newFS(t, dev, 1), newFS(t, dev, 2)
	c1.mount()

	const files, size = 5, 64 << 10 // 64 KiB: served by a worker
	var nodes, fhs []uint64
	for i := range files {
		node, fh := c1.create(vmm.RootID, fmt.Sprintf("m%d", i), syscall.O_RDWR)
		c2.write(node, fh, 0, pattern(i, size))
		c1.read(node, fh, 0, size)
		nodes, fhs = append(nodes, node), append(fhs, fh)
	}
	if _, err := c2.Lookup(vmm.RootID, "absent"); err == nil {
		t.Fatal("LOOKUP of an absent name succeeded")
	}
	s := scrape(t, msock)
	want := map[string]float64{
		`govirtiofsd_fuse_requests_total{opcode="INIT"}`:                  1,
		`govirtiofsd_fuse_requests_total{opcode="CREATE"}`:                files,
		`govirtiofsd_fuse_requests_total{opcode="WRITE"}`:                 files,
		`govirtiofsd_fuse_requests_total{opcode="READ"}`:                  files,
		`govirtiofsd_fuse_requests_total{opcode="LOOKUP"}`:                1,
		`govirtiofsd_fuse_errors_total{opcode="LOOKUP"}`:                  1,
		`govirtiofsd_fuse_errors_total{opcode="WRITE"}`:                   0,
		`govirtiofsd_read_bytes_total`:                                    files * size,
		`govirtiofsd_written_bytes_total`:                                 files * size,
		`govirtiofsd_queue_completed_total{queue="1"}`:                    1 + 2*files,
		`govirtiofsd_queue_completed_total{queue="2"}`:                    files + 1,
		`govirtiofsd_queue_inflight{queue="1"}`:                           0,
		`govirtiofsd_queue_depth{queue="2"}`:                              0,
		`govirtiofsd_queue_active{queue="1"}`:                             1,
		`govirtiofsd_open_inodes`:                                         1 + files,
		`govirtiofsd_open_handles`:                                        files,
		`govirtiofsd_inodes_evicted`:                                      0,
		`govirtiofsd_inode_reopens_total`:                                 0,
		`govirtiofsd_inode_stale_total`:                                   0,
		`govirtiofsd_fuse_request_duration_seconds_count{opcode="WRITE"}`: files,
	}
	for k, v := range want {
		if got, ok := s[k]; !ok || got != v {
			t.Errorf("%s = %v (present %v), want %v", k, got, ok, v)
		}
	}
	if s[`govirtiofsd_inode_fds`] < 1 || s[`govirtiofsd_inode_fd_budget`] < 16 {
		t.Errorf("inode fds %v, budget %v", s[`govirtiofsd_inode_fds`], s[`govirtiofsd_inode_fd_budget`])
	}
	if s[`govirtiofsd_goroutines`] < 2 {
		t.Errorf("goroutines = %v", s[`govirtiofsd_goroutines`])
	}

	for i := range files {
		if err := c1.Release(nodes[i], fhs[i], syscall.O_RDWR); err != nil {
			t.Fatal(err)
		}
		if err := c1.Forget(nodes[i], 1); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(opTimeout)
	for {
		s = scrape(t, msock)
		if s[`govirtiofsd_open_handles`] == 0 && s[`govirtiofsd_open_inodes`] == 1 {
			break
		}
		if time.Now().After(deadline) { // FORGET has no reply: it may lag
			t.Fatalf("after RELEASE and FORGET: %v handles, %v inodes", s[`govirtiofsd_open_handles`], s[`govirtiofsd_open_inodes`])
		}
		time.Sleep(10 * time.Millisecond)
	}

	d.Signal(syscall.SIGTERM)
	if !d.Wait(exitTimeout) {
		t.Fatal("daemon did not exit on SIGTERM")
	}
	if _, err := net.Dial("unix", msock); err == nil {
		t.Error("metrics socket still answers after SIGTERM")
	}
}

// TestMetricsTCP: a localhost port works too, and a daemon without
// --metrics-addr opens no listening socket besides the vhost-user one.
func TestMetricsTCP(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	d := startDaemon(t, "--metrics-addr", addr)
	dev := d.connect(opts())
	newFS(t, dev, 1).mount()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), `govirtiofsd_fuse_requests_total{opcode="INIT"} 1`) {
		t.Errorf("scrape over TCP:\n%s", b)
	}
}
