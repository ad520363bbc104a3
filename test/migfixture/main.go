// Command migfixture regenerates the migration state fixtures of
// internal/passthrough/testdata and checks that each daemon loads the
// other's state, through the in-repo front end (test/vmm) as QEMU 10 drives
// a migration: the source's guest session, dirty logging on, the rings
// stopped, SET_DEVICE_STATE_FD(save); the destination, which sees no INIT,
// loads it before its rings start and serves the same node ids and file
// handles.
//
//	go build -o /tmp/govirtiofsd ./cmd/govirtiofsd
//	go run ./test/migfixture -rust .cache/peers/bin/virtiofsd-rust \
//	    -ours /tmp/govirtiofsd -out internal/passthrough/testdata
//
// (as root: the daemons switch credentials). -ours-args and -rust-args add
// arguments (e.g. "--migration-mode file-handles"; the Rust daemon then
// also needs "--modcaps=+dac_read_search" as a destination), and
// -same-share loads each state on the share it was saved on, as file
// handles and --migration-verify-handles need. It writes, per daemon,
// NAME.state (the stream, byte for byte) and NAME.json (the share's tree,
// the node ids the guest holds with their lookup counts, its open handles),
// for rust-1.13 and govirtiofsd; internal/passthrough's TestMigrationFixtures
// recreates the tree, loads each state and serves the ids. With -check (the
// default) it also loads each state into the other daemon and reads every
// handle there, and reports what happened.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/launch"
	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// Fixture describes a state: the share it was taken on and what the guest
// held.
type Fixture struct {
	Daemon  string   `json:"daemon"`
	Tree    []Entry  `json:"tree"`
	Nodes   []Node   `json:"nodes"`
	Handles []Handle `json:"handles"`
}

// Entry is one object of the share.
type Entry struct {
	Path string `json:"path"`
	Dir  bool   `json:"dir,omitempty"`
	Data string `json:"data,omitempty"`
}

// Node is a node id the guest holds, with its lookup count.
type Node struct {
	Path    string `json:"path"`
	ID      uint64 `json:"id"`
	Lookups uint64 `json:"lookups"`
}

// Handle is an open file or directory of the guest.
type Handle struct {
	Path  string `json:"path"`
	Node  uint64 `json:"node"`
	FH    uint64 `json:"fh"`
	Dir   bool   `json:"dir,omitempty"`
	Flags uint32 `json:"flags"`
}

// tree is the share: a directory looked up twice, a nested path, files
// opened for reading and writing, a directory opened, and x/y/z.txt whose
// parents the guest forgot (the Rust daemon then sends x and y only as
// the way to z).
var tree = []Entry{
	{Path: "dir", Dir: true},
	{Path: "dir/sub", Dir: true},
	{Path: "dir/sub/deep.txt", Data: "deep data\n"},
	{Path: "dir/a.txt", Data: "a"},
	{Path: "file.txt", Data: "file contents\n"},
	{Path: "hello.txt", Data: "hello"},
	{Path: "x", Dir: true},
	{Path: "x/y", Dir: true},
	{Path: "x/y/z.txt", Data: "zzz"},
}

// linux612Init is what Linux 6.12 offers at FUSE_INIT on virtio-fs.
const linux612Init = vmm.LinuxInitFlags | 1<<34 | 1<<35 | 1<<36 | 1<<38 | 1<<39 | 1<<40

const (
	opOpendir  = 27
	opReaddir  = 28
	oRDONLY    = 0
	oRDWR      = 2
	oDIRECTORY = 0o200000
)

func main() {
	rust := flag.String("rust", ".cache/peers/bin/virtiofsd-rust", "the Rust virtiofsd 1.13 (wrapper)")
	ours := flag.String("ours", "", "the govirtiofsd binary (empty: skip ours)")
	out := flag.String("out", "internal/passthrough/testdata", "where the fixtures go")
	check := flag.Bool("check", true, "load each daemon's state into the other")
	oursArgs := flag.String("ours-args", "", "more arguments for govirtiofsd, space-separated (e.g. --migration-mode file-handles)")
	rustArgs := flag.String("rust-args", "", "more arguments for the Rust virtiofsd, space-separated")
	sameShare := flag.Bool("same-share", false, "load each state on the share it was saved on (for file handles), not on a copy")
	flag.Parse()
	extraArgs["govirtiofsd"] = strings.Fields(*oursArgs)
	extraArgs["rust-1.13"] = strings.Fields(*rustArgs)
	log.SetFlags(0)

	work, err := os.MkdirTemp("", "migfixture")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(work)

	daemons := []struct{ name, bin string }{{"rust-1.13", *rust}}
	if *ours != "" {
		daemons = append(daemons, struct{ name, bin string }{"govirtiofsd", *ours})
	}
	states := map[string][]byte{}
	fixtures := map[string]*Fixture{}
	shares := map[string]string{}
	for _, d := range daemons {
		st, fx, share, err := capture(work, d.name, d.bin)
		if err != nil {
			log.Fatalf("%s: %v", d.name, err)
		}
		states[d.name], fixtures[d.name], shares[d.name] = st, fx, share
		if err := os.WriteFile(filepath.Join(*out, d.name+".state"), st, 0o644); err != nil {
			log.Fatal(err)
		}
		j, _ := json.MarshalIndent(fx, "", "  ")
		if err := os.WriteFile(filepath.Join(*out, d.name+".json"), append(j, '\n'), 0o644); err != nil {
			log.Fatal(err)
		}
		log.Printf("%s: state of %d bytes, %d nodes, %d handles", d.name, len(st), len(fx.Nodes), len(fx.Handles))
	}
	if !*check || *ours == "" {
		return
	}
	for _, c := range []struct{ from, to, bin string }{{"govirtiofsd", "rust-1.13", *rust}, {"rust-1.13", "govirtiofsd", *ours}} {
		share := ""
		if *sameShare {
			share = shares[c.from]
		}
		if err := crossLoad(work, c.to, c.bin, share, states[c.from], fixtures[c.from]); err != nil {
			log.Printf("%s's state into %s: FAILED: %v", c.from, c.to, err)
			continue
		}
		log.Printf("%s's state into %s: loaded; every node and handle served", c.from, c.to)
	}
}

// extraArgs are more command-line arguments per daemon name.
var extraArgs = map[string][]string{}

// daemon is a running back end on a fresh share.
type daemon struct {
	*launch.Process
	sock  string
	share string
}

func (d *daemon) stop() { d.Stop(0, launch.Step{Signal: syscall.SIGTERM, Wait: 5 * time.Second}) }

// start starts bin on share, or on a new share with the tree when share is
// "".
func start(work, name, bin, share string) (*daemon, error) {
	dir, err := os.MkdirTemp(work, name)
	if err != nil {
		return nil, err
	}
	if share == "" {
		share = filepath.Join(dir, "share")
		if err := makeTree(share); err != nil {
			return nil, err
		}
	}
	d := &daemon{sock: filepath.Join(dir, "sock"), share: share}
	line := launch.Line{Kind: launch.Ours, Socket: d.sock, Share: share, Extra: []string{"--sandbox", "none", "--seccomp", "none"}}
	if strings.Contains(name, "rust") {
		line.Kind, line.Extra = launch.Rust, append(line.Extra, "--log-level", "debug")
		line.Extra = append(line.Extra, extraArgs["rust-1.13"]...)
	} else {
		line.Extra = append(line.Extra, extraArgs["govirtiofsd"]...)
	}
	if d.Process, err = (launch.Spec{Bin: bin, Args: line.Args(), Group: true, Log: filepath.Join(dir, "log")}).Start(); err != nil {
		return nil, err
	}
	if err := d.WaitSocket(d.sock, 10*time.Second); err != nil {
		d.stop()
		return nil, err
	}
	return d, nil
}

func makeTree(share string) error {
	if err := os.MkdirAll(share, 0o755); err != nil {
		return err
	}
	for _, e := range tree {
		p := filepath.Join(share, e.Path)
		var err error
		if e.Dir {
			err = os.Mkdir(p, 0o755)
		} else {
			err = os.WriteFile(p, []byte(e.Data), 0o644)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// opts is the device as QEMU 10 drives it: DEVICE_STATE acked, and
// SET_VRING_ENABLE awaited (the Rust daemon drops a kick that beats it).
func opts() vmm.Options {
	o := vmm.DefaultOptions()
	o.ProtocolFeatures |= vmm.Bit(vmm.PDeviceState)
	o.Ack = vmm.AckQEMU10
	return o
}

// capture runs the guest's session on bin and saves its state; it
// returns the state, its description and the share.
func capture(work, name, bin string) ([]byte, *Fixture, string, error) {
	d, err := start(work, name, bin, "")
	if err != nil {
		return nil, nil, "", err
	}
	defer d.stop()
	state, fx, err := session(d, name)
	return state, fx, d.share, err
}

// session runs the guest's session on d and saves its state.
func session(d *daemon, name string) ([]byte, *Fixture, error) {
	dev, err := vmm.Start(d.sock, opts())
	if err != nil {
		return nil, nil, fmt.Errorf("start: %w (%s)", err, d.Tail(40))
	}
	defer dev.Close()
	s := vmm.NewSession(dev, 1)
	if _, err := s.Init(41, linux612Init); err != nil {
		return nil, nil, fmt.Errorf("INIT: %w", err)
	}
	fx := &Fixture{Daemon: name, Tree: tree}
	ids := map[string]uint64{"": vmm.RootID}
	lookups := map[string]uint64{}
	lookup := func(p string) error {
		parent, base := filepath.Dir(p), filepath.Base(p)
		if parent == "." {
			parent = ""
		}
		e, err := s.Lookup(ids[parent], base)
		if err != nil {
			return fmt.Errorf("LOOKUP %s: %w", p, err)
		}
		ids[p] = e.NodeID
		lookups[p]++
		return nil
	}
	for _, p := range []string{"dir", "dir", "dir/sub", "dir/sub/deep.txt", "dir/a.txt", "file.txt", "hello.txt",
		"x", "x/y", "x/y/z.txt"} {
		if err := lookup(p); err != nil {
			return nil, nil, err
		}
	}
	for _, p := range []string{"x", "x/y"} {
		if err := s.Forget(ids[p], 1); err != nil {
			return nil, nil, err
		}
		delete(lookups, p)
	}
	for _, o := range []struct {
		path  string
		flags uint32
		dir   bool
	}{{"file.txt", oRDWR, false}, {"dir/sub/deep.txt", oRDONLY, false}, {"dir", oRDONLY, true}, {"x/y/z.txt", oRDONLY, false}} {
		var fh uint64
		if o.dir {
			b, err := s.Call(opOpendir, ids[o.path], le32x2(o.flags, 0), nil, 16)
			if err != nil {
				return nil, nil, fmt.Errorf("OPENDIR %s: %w", o.path, err)
			}
			fh = le64(b)
		} else if fh, err = s.Open(ids[o.path], o.flags); err != nil {
			return nil, nil, fmt.Errorf("OPEN %s: %w", o.path, err)
		}
		fx.Handles = append(fx.Handles, Handle{Path: o.path, Node: ids[o.path], FH: fh, Dir: o.dir, Flags: o.flags})
	}
	for p, n := range lookups {
		fx.Nodes = append(fx.Nodes, Node{Path: p, ID: ids[p], Lookups: n})
	}
	slices.SortFunc(fx.Nodes, func(a, b Node) int { return strings.Compare(a.Path, b.Path) })

	l, err := vmm.NewDirtyLogFor(dev.Mem)
	if err != nil {
		return nil, nil, err
	}
	defer l.Close()
	if err := dev.StartLogging(l); err != nil {
		return nil, nil, fmt.Errorf("start logging: %w", err)
	}
	time.Sleep(300 * time.Millisecond) // the guest runs on while paths are collected
	if _, err := dev.Stop(); err != nil {
		return nil, nil, err
	}
	st, err := dev.SaveState()
	if err != nil {
		return nil, nil, fmt.Errorf("save: %w (%s)", err, d.Tail(40))
	}
	return st, fx, nil
}

// crossLoad loads state (described by fx) into a fresh bin on share (""
// for a copy of the tree) and reads every handle and stats every node,
// without INIT.
func crossLoad(work, name, bin, share string, state []byte, fx *Fixture) error {
	d, err := start(work, name+"-dest", bin, share)
	if err != nil {
		return err
	}
	defer d.stop()
	dev, err := vmm.Connect(d.sock, opts())
	if err != nil {
		return err
	}
	defer dev.Close()
	if err := dev.Init(); err != nil {
		return err
	}
	if _, err := dev.Conn.GetFeatures(); err != nil { // in step with the unanswered SET_VRING_CALL/ERR
		return err
	}
	if err := dev.LoadState(state); err != nil {
		return fmt.Errorf("load: %w (%s)", err, d.Tail(40))
	}
	if err := dev.StartRings(); err != nil {
		return err
	}
	s := vmm.NewSession(dev, 1)
	data := map[string]string{}
	for _, e := range fx.Tree {
		data[e.Path] = e.Data
	}
	var errs []error
	for _, n := range fx.Nodes {
		if _, err := s.Getattr(n.ID); err != nil {
			errs = append(errs, fmt.Errorf("GETATTR %s (%#x): %w", n.Path, n.ID, err))
		}
	}
	for _, h := range fx.Handles {
		if h.Dir {
			b, err := s.Call(opReaddir, h.Node, vmm.ReadWriteIn(h.FH, 0, 4096, 0), nil, 4096)
			if err != nil || len(b) == 0 {
				errs = append(errs, fmt.Errorf("READDIR %s (fh %#x): %v", h.Path, h.FH, err))
			}
			continue
		}
		b, err := s.Read(h.Node, h.FH, 0, 4096)
		if err != nil || string(b) != data[h.Path] {
			errs = append(errs, fmt.Errorf("READ %s (fh %#x): %q, %v", h.Path, h.FH, b, err))
		}
	}
	// A new lookup gets a new id, and the handles close.
	e, err := s.Lookup(vmm.RootID, "hello.txt")
	if err != nil {
		errs = append(errs, fmt.Errorf("LOOKUP after the load: %w", err))
	} else if i := slices.IndexFunc(fx.Nodes, func(n Node) bool { return n.Path == "hello.txt" }); i >= 0 && e.NodeID != fx.Nodes[i].ID {
		errs = append(errs, fmt.Errorf("LOOKUP hello.txt gives %#x, restored as %#x", e.NodeID, fx.Nodes[i].ID))
	}
	for _, h := range fx.Handles {
		op := uint32(18) // RELEASE
		if h.Dir {
			op = 29 // RELEASEDIR
		}
		if _, err := s.Call(op, h.Node, le64x3(h.FH, 0, 0), nil, 0); err != nil {
			errs = append(errs, fmt.Errorf("RELEASE %s: %w", h.Path, err))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w\n%s", errors.Join(errs...), d.Tail(40))
	}
	return nil
}

func le32x2(a, b uint32) []byte {
	return []byte{byte(a), byte(a >> 8), byte(a >> 16), byte(a >> 24), byte(b), byte(b >> 8), byte(b >> 16), byte(b >> 24)}
}

func le64(b []byte) uint64 {
	var v uint64
	for i := 7; i >= 0; i-- {
		v = v<<8 | uint64(b[i])
	}
	return v
}

func le64x3(a, b, c uint64) []byte {
	var out []byte
	for _, v := range []uint64{a, b, c} {
		for i := range 8 {
			out = append(out, byte(v>>(8*i)))
		}
	}
	return out
}
