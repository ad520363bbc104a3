package integration

import (
	"bytes"
	"fmt"
	"strings"
	"testing"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// The features README.md documents as offered.
const (
	wantFeatures = 1<<vmm.FVersion1 | 1<<vmm.FIndirectDesc | 1<<vmm.FEventIdx | 1<<vmm.FProtocolFeatures |
		1<<vmm.FLogAll | 1<<vmm.FRingPacked
	wantProtocol = 1<<vmm.PMQ | 1<<vmm.PLogShmfd | 1<<vmm.PReplyAck | 1<<vmm.PBackendReq | 1<<vmm.PBackendSendFd |
		1<<vmm.PResetDevice | 1<<vmm.PConfigureMemSlots | 1<<vmm.PStatus | 1<<vmm.PDeviceState
)

// TestNegotiation checks what the daemon offers and answers with its
// default options, as QEMU 7.2 sees it at start-up.
func TestNegotiation(t *testing.T) {
	d := startDaemon(t)
	dev := d.connect(opts())
	if dev.Offered != wantFeatures {
		t.Errorf("GET_FEATURES = %#x, want %#x (VERSION_1, INDIRECT_DESC, EVENT_IDX, RING_PACKED, PROTOCOL_FEATURES, LOG_ALL)", dev.Offered, uint64(wantFeatures))
	}
	if dev.Offered&vmm.Bit(vmm.FRingReset) != 0 {
		t.Errorf("RING_RESET (bit 40) offered: QEMU 7.2 mishandles it")
	}
	if dev.OfferedProtocol != wantProtocol {
		t.Errorf("GET_PROTOCOL_FEATURES = %#x, want %#x", dev.OfferedProtocol, uint64(wantProtocol))
	}
	if dev.OfferedProtocol&vmm.Bit(vmm.PConfig) != 0 {
		t.Errorf("CONFIG offered without --tag")
	}
	// QEMU 7.2 knows bits 0-16 and acks the offer masked with them
	// (vhost_user_backend_init): DEVICE_STATE (19) is for QEMU >= 8.2.
	if hi := dev.OfferedProtocol >> 17; hi != 1<<(vmm.PDeviceState-17) {
		t.Errorf("protocol bits above 16 offered: %#x, want DEVICE_STATE only", hi<<17)
	}
	if want := dev.OfferedProtocol & vmm.QEMUProtocolFeatures; dev.ProtocolFeatures != want {
		t.Errorf("QEMU 7.2 acks %#x of %#x, want %#x", dev.ProtocolFeatures, dev.OfferedProtocol, want)
	}
	if dev.QueueNum != 256 {
		t.Errorf("GET_QUEUE_NUM = %d, want 256 (1 + default --queues 255)", dev.QueueNum)
	}
	if dev.MaxMemSlots != 509 {
		t.Errorf("GET_MAX_MEM_SLOTS = %d, want 509", dev.MaxMemSlots)
	}
	if dev.Backend == nil {
		t.Errorf("no backend channel after SET_BACKEND_REQ_FD")
	}
	// Start sent GET_STATUS and SET_STATUS(FEATURES_OK), as QEMU 7.2.
	s, err := dev.Conn.GetStatus()
	if err != nil || s != vmm.StatusFeaturesOK {
		t.Errorf("GET_STATUS = %#x, %v; want FEATURES_OK", s, err)
	}
	c := newFS(t, dev, 1)
	init := c.mount()
	t.Logf("FUSE_INIT: %d.%d flags %#x max_write %d max_pages %d", init.Major, init.Minor, init.Flags, init.MaxWrite, init.MaxPages)
	c.roundTrip(d, "negotiated", pattern(1, 5000))
	noViolations(t, dev)
}

// TestNegotiationQueuesAndTag: GET_QUEUE_NUM follows --queues, CONFIG is
// offered with --tag and GET_CONFIG answers struct virtio_fs_config, whose
// num_request_queues is --queues unless the front end set up fewer rings
// (SET_VRING_CALL at realize): then the rings less hiprio, as a guest of
// QEMU's generic vhost-user-test-device-pci must be told.
func TestNegotiationQueuesAndTag(t *testing.T) {
	const tag = "myfs-tag"
	d := startDaemon(t, "--queues", "3", "--tag", tag)
	o := opts()
	o.ProtocolFeatures = vmm.QEMUProtocolFeatures | vmm.Bit(vmm.PConfig) // a front end that knows CONFIG
	o.Queues = 5                                                         // more rings than --queues: capped by --queues
	dev := d.connect(o)
	if dev.QueueNum != 4 {
		t.Errorf("GET_QUEUE_NUM = %d, want 4 (hiprio + --queues 3)", dev.QueueNum)
	}
	if dev.OfferedProtocol != wantProtocol|vmm.Bit(vmm.PConfig) {
		t.Errorf("GET_PROTOCOL_FEATURES with --tag = %#x, want %#x", dev.OfferedProtocol, wantProtocol|vmm.Bit(vmm.PConfig))
	}
	cfg, err := dev.Conn.GetConfig(0, 40, 0)
	if err != nil {
		t.Fatalf("GET_CONFIG: %v", err)
	}
	want := make([]byte, 40)
	copy(want, tag)
	le.PutUint32(want[36:], 3)
	if !bytes.Equal(cfg, want) {
		t.Errorf("GET_CONFIG = %q, want %q", cfg, want)
	}
	// A part of the config space.
	part, err := dev.Conn.GetConfig(36, 4, 0)
	if err != nil {
		t.Fatalf("GET_CONFIG at 36: %v", err)
	}
	if !bytes.Equal(part, want[36:]) {
		t.Errorf("GET_CONFIG(36, 4) = %x, want %x", part, want[36:])
	}
	// The config space is read-only.
	setCfg := vmm.ConfigMsg{Offset: 0, Size: 5, Payload: []byte("other")}.Bytes()
	if _, err := dev.Conn.CallFlags(vmm.SetConfig, setCfg, nil, true); replyErr(err) == 0 {
		t.Errorf("SET_CONFIG: %v, want a REPLY_ACK failure", err)
	}
	// Fewer rings than GET_QUEUE_NUM announced (num_vqs=2 of the generic
	// device): the config follows the rings, and QEMU uses what it wants.
	dev.Close()
	d2 := startDaemon(t, "--queues", "3", "--tag", tag)
	o.Queues = 2
	dev = d2.connect(o)
	le.PutUint32(want[36:], 1)
	if cfg, err := dev.Conn.GetConfig(0, 40, 0); err != nil || !bytes.Equal(cfg, want) {
		t.Errorf("GET_CONFIG with 2 rings set up = %q (%v), want %q", cfg, err, want)
	}
	d = d2
	c := newFS(t, dev, 1)
	c.mount()
	c.roundTrip(d, "tagged", pattern(2, 100))
	if got, _ := dev.Conn.GetConfig(0, 36, 0); !bytes.Equal(got, want[:36]) {
		t.Errorf("GET_CONFIG after SET_CONFIG = %q", got)
	}
	noViolations(t, dev)
}

// TestNegotiationMoreRingsThanAdvertised: QEMU 7.2 ignores GET_QUEUE_NUM
// for fs and sets up num-request-queues + 1 rings regardless; every ring it
// configures must be served.
func TestNegotiationMoreRingsThanAdvertised(t *testing.T) {
	d := startDaemon(t, "--queues", "1")
	o := opts()
	o.Queues = 4
	dev := d.connect(o)
	if dev.QueueNum != 2 {
		t.Errorf("GET_QUEUE_NUM = %d, want 2", dev.QueueNum)
	}
	newFS(t, dev, 1).mount()
	for ring := 1; ring < 4; ring++ {
		newFS(t, dev, ring).roundTrip(d, fmt.Sprintf("ring%d", ring), pattern(ring, 3000))
	}
	noViolations(t, dev)
}

// TestNegotiationStatus: SET_STATUS is recorded for GET_STATUS and does not
// drive the ring lifecycle (QEMU 7.2 never sends DRIVER_OK or 0 for fs).
func TestNegotiationStatus(t *testing.T) {
	d := startDaemon(t)
	o := opts()
	o.Ack = vmm.AckAll
	dev := d.connect(o)
	c := newFS(t, dev, 1)
	c.mount()
	for _, s := range []uint8{vmm.StatusAcknowledge | vmm.StatusDriver | vmm.StatusFeaturesOK | vmm.StatusDriverOK, 0, vmm.StatusFeaturesOK} {
		if err := dev.Conn.SetStatus(s); err != nil {
			t.Fatalf("SET_STATUS %#x: %v", s, err)
		}
		got, err := dev.Conn.GetStatus()
		if err != nil || got != s {
			t.Errorf("GET_STATUS after SET_STATUS %#x = %#x, %v", s, got, err)
		}
		c.check() // the rings still serve
	}
	noViolations(t, dev)
}

// TestNegotiationRefusesUnofferedFeatures: acking a feature that was not
// offered is refused with a REPLY_ACK failure, and the daemon stays usable.
func TestNegotiationRefusesUnofferedFeatures(t *testing.T) {
	d := startDaemon(t)
	dev := d.dial(opts())
	cn := dev.Conn
	offered, err := cn.GetFeatures()
	if err != nil {
		t.Fatal(err)
	}
	proto, err := cn.GetProtocolFeatures()
	if err != nil {
		t.Fatal(err)
	}
	if err := cn.SetProtocolFeatures(proto); err != nil {
		t.Fatal(err)
	}
	for _, bit := range []uint{vmm.PInflightShmfd, vmm.PHostNotifier, 63} {
		_, err := cn.CallFlags(vmm.SetProtocolFeatures, vmm.U64(proto|vmm.Bit(bit)), nil, true)
		if replyErr(err) == 0 {
			t.Errorf("SET_PROTOCOL_FEATURES with bit %d not offered: %v, want refused", bit, err)
		}
	}
	for _, bit := range []uint{vmm.FRingReset, vmm.FNotifyOnEmpty, 63} {
		_, err := cn.CallFlags(vmm.SetFeatures, vmm.U64(offered|vmm.Bit(bit)), nil, true)
		if replyErr(err) == 0 {
			t.Errorf("SET_FEATURES with bit %d not offered: %v, want refused", bit, err)
		}
	}
	// The refused messages changed nothing: the QEMU flow still works.
	if err := dev.Init(); err != nil {
		t.Fatal(err)
	}
	if err := dev.StartRings(); err != nil {
		t.Fatal(err)
	}
	c := newFS(t, dev, 1)
	c.mount()
	c.roundTrip(d, "after-refusal", pattern(3, 4096))
	noViolations(t, dev)
}

// legacyStart brings a device up as a front end that knows no protocol
// features at all: GET_FEATURES, SET_OWNER, CALL/ERR, then SET_FEATURES
// without PROTOCOL_FEATURES, SET_MEM_TABLE and the rings (which start
// enabled on SET_VRING_KICK: there is no SET_VRING_ENABLE).
func legacyStart(t *testing.T, d *daemon, o vmm.Options) *vmm.Device {
	t.Helper()
	dev := d.dial(o)
	var err error
	if dev.Offered, err = dev.Conn.GetFeatures(); err != nil {
		t.Fatal(err)
	}
	if err := dev.Conn.SetOwner(); err != nil {
		t.Fatal(err)
	}
	for i, q := range dev.Queues {
		if err := dev.Conn.SetVringCall(uint32(i), q.CallFd()); err != nil {
			t.Fatal(err)
		}
		if err := dev.Conn.SetVringErr(uint32(i), q.ErrFd()); err != nil {
			t.Fatal(err)
		}
	}
	if err := dev.StartRings(); err != nil {
		t.Fatal(err)
	}
	return dev
}

// TestOlderPeers runs the data path, a pause/resume and a guest reset with
// front ends that negotiate less than QEMU 7.2 does.
func TestOlderPeers(t *testing.T) {
	const noVersion = 1<<vmm.FIndirectDesc | 1<<vmm.FEventIdx | 1<<vmm.FProtocolFeatures
	cases := []struct {
		name     string
		features uint64
		protocol uint64
		legacy   bool // no PROTOCOL_FEATURES at all
	}{
		{name: "no-protocol-features", features: vmm.DefaultFeatures &^ vmm.Bit(vmm.FProtocolFeatures), legacy: true},
		{name: "no-protocol-features-no-ring-features", features: 1 << vmm.FVersion1, legacy: true},
		{name: "no-event-idx-no-indirect", features: 1<<vmm.FVersion1 | 1<<vmm.FProtocolFeatures},
		{name: "no-event-idx", features: vmm.DefaultFeatures &^ vmm.Bit(vmm.FEventIdx)},
		{name: "no-indirect", features: vmm.DefaultFeatures &^ vmm.Bit(vmm.FIndirectDesc)},
		{name: "no-version-1", features: noVersion},
		{name: "no-configure-mem-slots", protocol: vmm.QEMUProtocolFeatures &^ vmm.Bit(vmm.PConfigureMemSlots)},
		{name: "no-reply-ack", protocol: vmm.QEMUProtocolFeatures &^ vmm.Bit(vmm.PReplyAck)},
		{name: "no-status-no-mq-no-backend", protocol: vmm.Bit(vmm.PReplyAck) | vmm.Bit(vmm.PConfigureMemSlots)},
		{name: "only-reply-ack", protocol: vmm.Bit(vmm.PReplyAck)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := startDaemon(t)
			o := opts()
			o.Features, o.ProtocolFeatures = tc.features, tc.protocol
			var dev *vmm.Device
			if tc.legacy {
				dev = legacyStart(t, d, o)
			} else {
				dev = d.connect(o)
			}
			if tc.features != 0 && dev.Features != tc.features {
				t.Fatalf("negotiated %#x, want %#x", dev.Features, tc.features)
			}
			memTables := d.logCount("request=SET_MEM_TABLE")
			c := newFS(t, dev, 1)
			c.mount()
			c.roundTrip(d, "first", pattern(1, 3*4096+100))

			// Pause and resume (QEMU: vhost_dev_stop / start).
			if _, err := dev.Stop(); err != nil {
				t.Fatalf("stop: %v", err)
			}
			if err := dev.Restart(false); err != nil {
				t.Fatalf("restart: %v", err)
			}
			c.roundTrip(d, "after-resume", pattern(2, 5000))
			if !dev.HasProtocol(vmm.PConfigureMemSlots) {
				// QEMU resends the whole table on every start.
				if n := d.logCount("request=SET_MEM_TABLE"); n <= memTables {
					t.Errorf("SET_MEM_TABLE seen %d times, want more than %d after a restart", n, memTables)
				}
			}

			// A chain with an indirect descriptor when INDIRECT_DESC was not
			// negotiated is malformed; the ring goes on.
			if !dev.Negotiated(vmm.FIndirectDesc) {
				q := dev.Queue(1)
				in := vmm.BuildRequest(c.Header(vmm.OpGetattr, vmm.RootID), 0, make([]byte, 16))
				fc, err := q.SubmitFuse(vmm.FuseRequest{In: in, OutArgs: vmm.FuseAttrOutSize, Indirect: vmm.IndirectAlways})
				if err != nil {
					t.Fatal(err)
				}
				if n, err := fc.Chain.Wait(opTimeout); err != nil || n != 0 {
					t.Errorf("indirect chain without INDIRECT_DESC: used len %d, %v; want 0", n, err)
				}
				c.check()
			}

			// Guest reboot: new rings at base 0, FUSE_INIT again.
			if err := dev.GuestReset(); err != nil {
				t.Fatalf("guest reset: %v", err)
			}
			c.mount()
			first := c.lookup(vmm.RootID, "first").NodeID
			if got := c.read(first, c.open(first, 0), 0, 100); !bytes.Equal(got, pattern(1, 100)) {
				t.Errorf("after reset: read %x, want %x", got[:8], pattern(1, 8))
			}
			c.roundTrip(d, "after-reset", pattern(3, 70000))
			noViolations(t, dev)
			if strings.Contains(d.Log(), "level=ERROR") {
				t.Errorf("daemon logged an error")
			}
		})
	}
}
